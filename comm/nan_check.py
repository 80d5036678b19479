"""``nan_check``: gradients are checked for NaN/Inf before they are sent."""

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ._base import CommHook, HookState, Setup, Wrapper, check_hook
from ._collectives import Link
from .allreduce import allreduce

__all__ = ["NanCheck", "NanCheckState", "nan_check"]


class NanCheckState(HookState):
    __slots__ = ("action", "inner", "skipped")

    def __init__(self, action: str, inner: HookState) -> None:
        super().__init__()
        self.action = action
        self.inner = inner
        self.skipped = 0  # buckets whose non-finite gradients were zeroed (action="skip")

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class NanCheck(Wrapper):
    __slots__ = ("_names",)
    syncs = True  # reads a non-finite flag on the host per bucket

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        self._names = ctx.names
        super().setup_tree(state, ctx)

    def reduce(self, state: NanCheckState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        # One host sync per bucket: the price of knowing before anything is sent.
        if not bool(torch.isfinite(buf).all()):
            names = getattr(self, "_names", None) or {}
            params = list(bucket.parameters())
            bad = []
            for i, g in enumerate(bucket.gradients()):
                if not bool(torch.isfinite(g).all()):
                    p = params[i] if i < len(params) else None
                    bad.append(
                        names.get(p, f"#{i} {tuple(g.shape)}")
                        if p is not None
                        else f"view #{i} {tuple(g.shape)}"
                    )
                    if state.action == "skip":
                        g.zero_()
            rank = dist.get_rank() if dist.is_initialized() else 0
            msg = (
                f"aiak.comm.nan_check: rank {rank}: non-finite gradients in bucket "
                f"{bucket.index()} before communication: parameters {bad}"
            )
            if state.action == "raise":
                raise FloatingPointError(msg)
            state.skipped += 1
            warnings.warn(msg + " (zeroed on this rank)", RuntimeWarning, stacklevel=2)
        return self.inner.reduce(state.inner, bucket, link)


def nan_check(inner: CommHook | None = None, action: str = "raise") -> CommHook:
    """Check gradients for NaN/Inf before ``inner`` sends them.

    ``action="raise"``: ``FloatingPointError`` naming the rank and the parameters (the peers
    then fail at their collective timeout). ``"skip"``: this rank's non-finite gradients are
    zeroed (its share of the average is 0), a warning names them, ``state.skipped`` counts.
    """
    inner = allreduce() if inner is None else inner
    check_hook("nan_check", "inner", inner)
    if action not in ("raise", "skip"):
        raise ValueError(f"nan_check: action must be 'raise' or 'skip', got {action!r}")
    return NanCheck(NanCheckState(action, inner.state), inner)
