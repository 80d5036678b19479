"""Gossip downsampling with gradient momentum (Perseus's PERSEUS_DOWNSAMPLE_N_ELEMENTS and
PERSEUS_GRADIENT_MOMENTUM).

Each step communicates a rotating ``1/n`` of every bucket: at step ``s`` the elements
``[c*L//n, (c+1)*L//n)`` with ``c = s % n`` (``L`` the bucket length), so every element
travels once every ``n`` steps. Every element keeps a local memory ``mem = momentum*mem + g``;
the travelling slice sends its memory (then zeroed) through ``inner``, and the bucket's result
is that averaged slice with zeros elsewhere. With ``momentum=1`` the memory is the sum of the
gradients since the element last travelled: nothing is lost, only delayed.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _buckets, _futures, _streams
from ._base import CommHook, HookState, Setup, Wrapper, check_hook
from ._collectives import Link
from .allreduce import allreduce

__all__ = ["DownsampleState", "downsample"]

MAX_N = 1024


class DownsampleState(HookState):
    __slots__ = ("inner", "memory", "momentum", "n")

    def __init__(self, n: int, momentum: float, inner: HookState) -> None:
        super().__init__()
        self.n = n
        self.momentum = momentum
        self.inner = inner
        self.memory: dict[str, torch.Tensor] = {}  # per parameter, fp32

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
        c = bucket.step % state.n
        lo, hi = c * length // state.n, (c + 1) * length // state.n
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
            mem.mul_(state.momentum).add_(flat)
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
            buf[lo:hi].copy_(value.reshape(-1)[: hi - lo])
            return buf

        return _futures.after(fut, place, buf)


def downsample(inner: CommHook | None = None, n: int = 2, momentum: float = 1.0) -> CommHook:
    """Send a rotating ``1/n`` of every bucket through ``inner`` (default: allreduce); the
    rest stays in a local memory with gradient ``momentum`` (see the module docstring).
    ``n``: an int in ``[1, MAX_N]`` (1024); ``momentum``: in ``(0, 1]``."""
    from aiak.ops._args import check_float, check_int  # lazily: `import aiak.comm` stays lean

    inner = allreduce() if inner is None else inner
    check_hook("downsample", "inner", inner)
    # An element travels once every n steps and a bucket shorter than n sends nothing on most
    # steps: beyond MAX_N the gradients would mostly wait, not train.
    n = check_int("n", n, ge=1, le=MAX_N, op="downsample")
    momentum = check_float("momentum", momentum, gt=0, le=1, op="downsample")
    return _Downsample(DownsampleState(n, momentum, inner.state), inner)
