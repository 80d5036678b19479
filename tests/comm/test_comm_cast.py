"""The fp16/bf16 cast hooks' encode and decode."""

from __future__ import annotations

import pytest
import torch

from aiak.comm import cast as comm_cast

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_encode_decode_compute_in_fp32(device: str, dtype: torch.dtype) -> None:
    scale = 1024.0  # a power of two: x*scale and w/scale are exact in fp32, so equality holds
    hook = comm_cast.cast_hook("t", dtype, None, scale)
    state = hook.state
    t = torch.randn(100_003, device=device) * 1e-6
    wire = hook.encode(state, t, t.numel() + 5)
    assert wire.dtype == dtype
    assert torch.equal(wire[: t.numel()], (t * scale).to(dtype)) and not wire[t.numel() :].any()
    # Decode in fp32: the smallest normal fp16 value / 1024 is ~6e-8, at the edge of fp16's
    # subnormals; an fp16 product would round it (and flush smaller ones), fp32 keeps it exact.
    tiny = torch.finfo(dtype).tiny
    wire[:3] = torch.tensor([tiny, 3 * tiny, -tiny], dtype=dtype)
    out = torch.full_like(t, float("nan"))
    hook.decode_(state, wire, out)
    assert torch.equal(out, wire[: t.numel()].double().div(scale).float())
    assert out[0].item() == tiny / scale != 0


@pytest.mark.parametrize("device", DEVICES)
def test_cast_scale_one_is_a_plain_cast(device: str) -> None:
    hook = comm_cast.cast_hook("t", torch.float16, None, 1.0)
    t = torch.randn(7, 5, device=device)
    wire = hook.encode(hook.state, t, 40)
    assert torch.equal(wire[:35], t.reshape(-1).half()) and not wire[35:].any()
    out = torch.empty_like(t)
    assert torch.equal(hook.decode_(hook.state, wire, out), t.half().float())


@pytest.mark.cuda
def test_cuda_cast_is_one_kernel_each_way() -> None:
    # The host cost per bucket is on DDP's critical path: one launch per direction.
    hook = comm_cast.cast_hook("t", torch.float16, None, 10.0)
    t = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(t)
    hook.decode_(hook.state, hook.encode(hook.state, t, t.numel()), out)  # warm, factor made
    torch.cuda.synchronize()
    wire = hook.encode(hook.state, t, t.numel())
    for fn in (
        lambda: hook.encode(hook.state, t, t.numel()),
        lambda: hook.decode_(hook.state, wire, out),
    ):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]
