"""What a cast hook's future carries: the fp16/bf16 wire itself when DDP called it at scale 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aiak import comm
from aiak.comm import _buckets, _futures

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fake import CountingGroup, IndexedBucket, ready


@pytest.mark.parametrize(
    ("make", "wire"),
    [
        (comm.fp16_compress, torch.float16),
        (comm.bf16_compress, torch.bfloat16),
        (lambda: comm.nan_check(comm.fp16_compress()), torch.float16),  # passes DDP's bucket on
        (lambda: comm.multi_stream(comm.fp16_compress(), streams=1), torch.float16),
        (lambda: comm.fp16_compress(scale=8), None),  # 1/scale needs a pass: decoded in place
    ],
)
@pytest.mark.parametrize("coalesce", [1, 2])
def test_top_level_cast_returns_the_averaged_wire(make, wire, coalesce) -> None:
    group = CountingGroup()  # its peer holds the same values: the average is the input
    hook = make()
    state = ready(hook, group, coalesce)
    buckets = [IndexedBucket(i, 2, 33) for i in range(2)]
    expect = [b.buf.clone() for b in buckets]
    futs = [hook.run(state, b) for b in buckets]
    for f, b, e in zip(futs, buckets, expect, strict=True):
        out = f.wait()
        assert out.numel() == b.buf.numel()
        if wire is None:
            assert out.data_ptr() == b.buf.data_ptr() and out.dtype == torch.float32
        else:
            # DDP copies the result into the gradients with a cast; the bucket is not written.
            assert out.dtype == wire and torch.equal(b.buf, e)
        torch.testing.assert_close(out.float(), e.to(out.dtype).float(), rtol=0, atol=0)


def test_inner_cast_decodes_into_its_buffer() -> None:
    # An inner hook's caller (hierarchical, a user's wrapper) expects its own buffer back.
    group = CountingGroup()
    hook = comm.fp16_compress()
    state = ready(hook, group)
    bucket = IndexedBucket(0, 1, 40)
    expect = bucket.buf.half().float()
    sub = _buckets.SubBucket(bucket.buffer(), None, bucket, step=0)
    assert sub.wire_ok is False
    out = _futures.real(hook.reduce(state, sub, state._link)).wait()
    assert out.data_ptr() == bucket.buf.data_ptr() and torch.equal(out, expect)
    # nor does a SubBucket inherit the flag from its parent
    sub.wire_ok = True
    assert _buckets.rebase(sub, bucket.buf.clone()).wire_ok is False


_ONE_RANK_DDP = """
import torch
import torch.distributed as dist
from aiak import comm
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
x = torch.randn(64, 256, device="cuda")
def grads(hook, view):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
    if hook is not None:
        comm.register(ddp, hook)
    for _ in range(3):  # DDP rebuilds its buckets at step 1
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    assert all(p.grad.dtype == torch.float32 for p in net.parameters())
    return torch.cat([p.grad.flatten() for p in net.parameters()])
for view in (False, True):
    ref = grads(None, view)
    for make, dtype in ((comm.fp16_compress, torch.float16), (comm.bf16_compress, torch.bfloat16)):
        got = grads(make(), view)
        assert torch.equal(got, ref.to(dtype).float()), (view, dtype)
print("ok")
comm.shutdown()
"""


@pytest.mark.cuda
def test_ddp_on_cuda_casts_the_wire_back_into_fp32_gradients() -> None:
    # One NCCL rank (the collective is the identity): what comes back is exactly the wire,
    # i.e. the gradients rounded to fp16/bf16, in fp32 .grad tensors, with and without
    # gradient_as_bucket_view. A process of its own: it sets up a default process group.
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _ONE_RANK_DDP], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
