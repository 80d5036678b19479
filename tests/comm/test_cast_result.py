"""What a cast hook's future carries: the fp16/bf16 wire itself when DDP called it at scale 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aiak import comm
from aiak.comm import _wire

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
    sub = _wire.SubBucket(bucket.buffer(), None, bucket, step=0)
    assert sub.wire_ok is False
    out = _wire.real(hook.reduce(state, sub, state._link)).wait()
    assert out.data_ptr() == bucket.buf.data_ptr() and torch.equal(out, expect)
    # nor does a SubBucket inherit the flag from its parent
    sub.wire_ok = True
    assert _wire.rebase(sub, bucket.buf.clone()).wire_ok is False
