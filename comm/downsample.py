"""Gossip downsampling with gradient momentum (Perseus's PERSEUS_DOWNSAMPLE_N_ELEMENTS and
PERSEUS_GRADIENT_MOMENTUM).

Each step communicates a rotating ``1/n`` of every bucket, chosen by ``c = s % n`` at step
``s`` (``L`` the bucket length):

* ``rotation="contiguous"`` (default): the block ``[c*L//n, (c+1)*L//n)``;
* ``rotation="strided"``: the elements ``c, c+n, c+2n, ...`` of the bucket (every tensor
  gets a share each step instead of a whole layer every ``n`` steps).

Either way every element travels once every ``n`` steps. Every element keeps a local memory
``mem = momentum*mem + g``; the travelling elements send their memory (then zeroed) through
``inner``, and the bucket's result is their average with zeros elsewhere. With ``momentum=1``
the memory is the sum of the gradients since the element last travelled: nothing is lost, only
delayed, so an element's update arrives as one step of up to ``n`` gradients.

``sgd_momentum=m > 0`` moves SGD's momentum into the hook (DGC's momentum correction): every
element keeps a velocity ``u = m*u + g`` every step, and the memory accumulates ``u`` instead
of ``g``; the optimizer then runs without gradient momentum (``aiak.comm.DGCSGD(momentum=m)``
applies momentum to weight decay only). An element's travelling update is then the velocity
steps it missed, with no optimizer momentum carrying a stale burst on after it arrives; with a
momentum optimizer instead, a burst of ``n`` delayed gradients keeps driving the parameter for
``~1/(1-m)`` steps while newer bursts arrive, which oscillates (docs/dgc.md: digits, 6 seeds).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _buckets, _futures, _streams
from ._base import CommHook, HookState, Setup, Wrapper, check_hook
from ._collectives import Link
from .allreduce import allreduce

__all__ = ["DownsampleState", "downsample"]


class DownsampleState(HookState):
    __slots__ = ("inner", "memory", "momentum", "n", "rotation", "sgd_momentum", "velocity")

    def __init__(
        self,
        n: int,
        momentum: float,
        inner: HookState,
        rotation: str = "contiguous",
        sgd_momentum: float = 0.0,
    ) -> None:
        super().__init__()
        self.n = n
        self.momentum = momentum
        self.rotation = rotation
        self.sgd_momentum = sgd_momentum
        self.inner = inner
        self.memory: dict[str, torch.Tensor] = {}  # per parameter, fp32
        self.velocity: dict[str, torch.Tensor] = {}  # per parameter, fp32 (sgd_momentum > 0)

    def __setstate__(self, d: dict[str, Any]) -> None:
        # a state pickled before these settings existed rotated blocks without velocity
        self.rotation, self.sgd_momentum, self.velocity = "contiguous", 0.0, {}
        super().__setstate__(d)

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class _Downsample(Wrapper):
    __slots__ = ()

    def setup_tree(self, state: DownsampleState, ctx: Setup) -> None:
        state._names = ctx.names
        super().setup_tree(state, ctx)

    def reduce(self, state: DownsampleState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        length, base = buf.numel(), buf.storage_offset()
        n_rot = state.n
        c = bucket.step % n_rot
        strided = state.rotation == "strided"
        if strided:  # bucket positions q = c (mod n); position q goes to send[q // n]
            lo, hi = 0, len(range(c, length, n_rot))
            out = buf[c::n_rot]
        else:
            lo, hi = c * length // n_rot, (c + 1) * length // n_rot
            out = buf[lo:hi]
        send = torch.empty(hi - lo, dtype=buf.dtype, device=buf.device)
        names = state._names or {}
        params = bucket.parameters()
        for i, g in enumerate(bucket.gradients()):
            n = g.numel()
            off = g.storage_offset() - base
            flat = buf[off : off + n]
            p = params[i] if i < len(params) else None
            key = (names.get(p) if p is not None else None) or f"{bucket.index()}.{i}.{n}"
            mem = state.memory.get(key)
            if mem is None or mem.numel() != n or mem.device != buf.device:
                mem = state.memory[key] = torch.zeros(n, dtype=torch.float32, device=buf.device)
            if state.sgd_momentum:
                vel = state.velocity.get(key)
                if vel is None or vel.numel() != n or vel.device != buf.device:
                    vel = state.velocity[key] = torch.zeros_like(mem)
                flat = vel.mul_(state.sgd_momentum).add_(flat)
            mem.mul_(state.momentum).add_(flat)
            if strided:
                first = (c - off) % n_rot  # this tensor's first travelling element
                if first < n:
                    mine = mem[first::n_rot]
                    a = (off + first) // n_rot
                    send[a : a + mine.numel()].copy_(mine)
                    mine.zero_()
            else:
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    send[a - lo : b - lo].copy_(mem[a - off : b - off])
                    mem[a - off : b - off].zero_()
        if hi == lo:  # a bucket shorter than n: this step sends none of it (on every rank)
            buf.zero_()
            return _futures.done(buf)
        fut = self.inner.reduce(state.inner, _buckets.SubBucket(send, [send], bucket), link)

        def place(value: torch.Tensor) -> torch.Tensor:
            _streams.keep(send)
            buf.zero_()
            out.copy_(value.reshape(-1)[: hi - lo])
            return buf

        return _futures.after(fut, place, buf)


def downsample(
    inner: CommHook | None = None,
    n: int = 2,
    momentum: float = 1.0,
    rotation: str = "contiguous",
    sgd_momentum: float = 0.0,
) -> CommHook:
    """Send a rotating ``1/n`` of every bucket through ``inner`` (default: allreduce); the
    rest stays in a local memory with gradient ``momentum``. ``rotation``: ``"strided"``
    (every ``n``-th element) or ``"contiguous"`` (blocks). ``sgd_momentum > 0``: SGD's
    momentum lives in the hook (pair with ``DGCSGD`` or an SGD without momentum); see the
    module docstring."""
    inner = allreduce() if inner is None else inner
    check_hook("downsample", "inner", inner)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"downsample: n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"downsample: n must be >= 1, got {n}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"downsample: momentum must be a number, got {type(momentum).__name__}")
    if not 0 < momentum <= 1:
        raise ValueError(f"downsample: momentum must be in (0, 1], got {momentum}")
    if rotation not in ("strided", "contiguous"):
        raise ValueError(
            f"downsample: rotation must be 'strided' or 'contiguous', got {rotation!r}"
        )
    if isinstance(sgd_momentum, bool) or not isinstance(sgd_momentum, (int, float)):
        raise TypeError(
            f"downsample: sgd_momentum must be a number, got {type(sgd_momentum).__name__}"
        )
    if not 0 <= sgd_momentum < 1:
        raise ValueError(f"downsample: sgd_momentum must be in [0, 1), got {sgd_momentum}")
    state = DownsampleState(n, float(momentum), inner.state, rotation, float(sgd_momentum))
    return _Downsample(state, inner)
