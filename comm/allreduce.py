"""``allreduce``: the plain averaging allreduce DDP does without a hook, with byte accounting."""

from typing import Any

import torch

from . import _collectives
from ._base import CommHook, HookState
from ._collectives import Link

__all__ = ["Allreduce", "AllreduceState", "allreduce"]


class AllreduceState(HookState):
    __slots__ = ()


class Allreduce(CommHook):
    __slots__ = ()

    def reduce(self, state: HookState, bucket: Any, link: Link) -> torch.futures.Future:
        batch = getattr(bucket, "batch", None)
        return _collectives.all_reduce_mean(bucket.buffer(), link, state.traffic, batch)


def allreduce() -> CommHook:
    """Plain averaging allreduce (what DDP does without a hook), with byte accounting."""
    return Allreduce(AllreduceState())
