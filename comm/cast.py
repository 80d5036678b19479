"""``fp16_compress`` / ``bf16_compress``: the gradients cross the wire in half precision.

The cast carries Perseus's gradient scale (multiply before the cast, divide after) and, when
DDP itself is the caller at scale 1, hands DDP the averaged wire to cast back.
"""

import math
from typing import Any

import torch

from . import _buckets, _futures, _streams
from ._base import CommHook, HookState, Wrapper, check_hook
from ._collectives import Link
from .allreduce import allreduce

__all__ = ["Cast", "CastState", "bf16_compress", "cast_hook", "fp16_compress"]


class CastState(HookState):
    __slots__ = ("_unscale", "dtype", "inner", "scale")

    def __init__(self, dtype: torch.dtype, scale: float, inner: HookState) -> None:
        super().__init__()
        self.dtype = dtype
        self.scale = scale  # Perseus's gradient scale: x*scale before the cast, /scale after
        self.inner = inner
        # run time, like every ``_`` field: None until first use and again after unpickling
        self._unscale: dict[torch.device, torch.Tensor] | None = None

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)

    def unscale_factor(self, device: torch.device) -> torch.Tensor:
        """``1/scale`` as a one-element fp32 tensor, made once per device (see :class:`Cast`)."""
        cache = self._unscale
        if cache is None:
            cache = self._unscale = {}
        t = cache.get(device)
        if t is None:
            t = cache[device] = torch.full((1,), 1.0 / self.scale, device=device)
        return t


class Cast(Wrapper):
    """Cast to ``dtype`` for the wire and back, with Perseus's gradient scale.

    Both directions compute in fp32 and round once: ``scale`` must lift small values before
    the cast to fp16, and ``1/scale`` must apply to the widened value, not to an fp16 product
    (which would round and flush what ``scale`` saved). Each direction is one torch kernel:
    encode ``mul(src_fp32, scale, out=wire)``; decode ``mul(wire, factor, out=dst)`` with the
    factor a one-element fp32 *tensor*, which makes the op compute in fp32.

    Why not aiak's kernels. ``aiak::cast_scale_`` does the same in one vectorised pass and
    saves GPU time (64 MB bucket on H200: encode 26 vs 32 µs, decode 39 vs 61 µs;
    benchmarks/bench_cast_scale.py), but its launch from Python costs the host more than the
    torch op's (12 µs against 8 µs on the H100 machine), and DDP calls hooks on its host-bound
    autograd thread: on 2 x H200 the 12 x Linear(4096) step took +6.9 ms over no hook with it
    (at 27 µs a launch) against +4.0 ms with torch ops (benchmarks/results/README.md).
    ``aiak::multi_tensor_scale_`` keys its device tables by addresses, and a new wire buffer
    per bucket misses that cache on every call (1261 vs 432 µs of host time per bucket, step
    +17.5 ms).
    """

    __slots__ = ()

    def encode(self, state: CastState, t: torch.Tensor, length: int) -> torch.Tensor:
        wire = torch.empty(length, dtype=state.dtype, device=t.device)
        n = t.numel()
        body = wire if length == n else wire[:n]  # each slice is host time (per bucket)
        flat = t if t.dim() == 1 else t.reshape(-1)  # bucket buffers are flat already
        if state.scale == 1.0:
            body.copy_(flat)
        else:
            torch.mul(flat, state.scale, out=body)
        if length > n:
            wire[n:].zero_()
        return wire

    def decode_(self, state: CastState, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = out.numel()
        src = wire if wire.numel() == n else wire[:n]
        if out.dim() != 1:  # bucket buffers are flat: no view (host time per bucket)
            src = src.view(out.shape)
        if state.scale == 1.0:
            out.copy_(src)
        elif out.is_contiguous():
            torch.mul(src, state.unscale_factor(out.device), out=out)
        else:  # not produced by our hooks (buffers are flat); keep it simple and correct
            out.copy_(src).mul_(1.0 / state.scale)
        return out

    def reduce(self, state: CastState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        if buf.dtype == state.dtype:  # already narrow (AMP O2 gradients): nothing to compress
            return self.inner.reduce(state.inner, bucket, link)
        wire = self.encode(state, buf, buf.numel())
        fut = self.inner.reduce(state.inner, _buckets.rebase(bucket, wire), link)
        if state.scale == 1.0 and getattr(bucket, "wire_ok", False):
            # The averaged wire goes back to DDP as it is: DDP copies every bucket's result
            # into the gradients anyway, and that copy casts. No decode launch and no decode
            # pass (64 MB bucket on H200: 60-70 µs of GPU time); host per bucket on the H100
            # machine 45-53 µs against 66-76 µs with a scale (profile_comm_host.py).
            return fut

        def decode(_: Any) -> torch.Tensor:
            _streams.keep(wire)  # read on this callback's stream, freed when we return
            return self.decode_(state, wire, buf)

        return _futures.after(fut, decode, buf)


def cast_hook(fn: str, dtype: torch.dtype, inner: CommHook | None, scale: float) -> CommHook:
    inner = allreduce() if inner is None else inner
    check_hook(fn, "inner", inner)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale must be a number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale must be finite and > 0, got {scale}")
    return Cast(CastState(dtype, float(scale), inner.state), inner)


def fp16_compress(inner: CommHook | None = None, scale: float = 1.0) -> CommHook:
    """Send gradients as fp16 through ``inner`` (default: allreduce).

    ``scale`` multiplies before the cast and divides after it (Perseus's gradient scale, 10 by
    default there) so that small gradients do not flush to zero in fp16.

    Called by DDP with ``scale=1`` (the default), the hook's future carries the averaged fp16
    wire itself: DDP copies every bucket's result into the gradients and that copy casts, so
    no decode pass is needed (the gradients stay fp32). Inside another hook, or with a scale,
    the result is decoded into the bucket's own buffer.
    """
    return cast_hook("fp16_compress", torch.float16, inner, scale)


def bf16_compress(inner: CommHook | None = None, scale: float = 1.0) -> CommHook:
    """Send gradients as bf16 through ``inner``; fp32's range, so ``scale`` is rarely needed.

    As :func:`fp16_compress`: at ``scale=1`` DDP receives the bf16 wire and casts it back.
    """
    return cast_hook("bf16_compress", torch.bfloat16, inner, scale)
