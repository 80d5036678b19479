"""``multi_stream``: buckets round-robin over k copies of the process group."""

from typing import Any

import torch

from ._base import CommHook, HookState, Setup, Wrapper, check_hook
from ._collectives import Link
from .allreduce import allreduce

__all__ = ["MultiStream", "MultiStreamState", "multi_stream"]


class MultiStreamState(HookState):
    __slots__ = ("_links", "inner", "streams")

    def __init__(self, streams: int, inner: HookState) -> None:
        super().__init__()
        self.streams = streams
        self.inner = inner
        self._links: list[Link] | None = None

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class MultiStream(Wrapper):
    __slots__ = ()

    def setup_tree(self, state: MultiStreamState, ctx: Setup) -> None:
        # Every rank creates the copies of every candidate group, in the same order.
        for ranks in ctx.candidates:
            for c in range(1, state.streams):
                ctx.topo.group(ranks, c)
        mine = ctx.candidates[ctx.mine]
        state._links = [ctx.topo.link(mine, c) for c in range(1, state.streams)]
        super().setup_tree(state, ctx)

    def reduce(self, state: MultiStreamState, bucket: Any, link: Link) -> torch.futures.Future:
        k = bucket.index() % state.streams
        if k and state._links and state._links[k - 1].ranks == link.ranks:
            link = state._links[k - 1]
        return self.inner.reduce(state.inner, bucket, link)


def multi_stream(inner: CommHook | None = None, streams: int = 2) -> CommHook:
    """Spread buckets round-robin over ``streams`` process groups (copies of the caller's).

    Each group has its own NCCL stream or gloo connections, so buckets are in flight together.
    """
    inner = allreduce() if inner is None else inner
    check_hook("multi_stream", "inner", inner)
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise TypeError(f"multi_stream: streams must be an int, got {type(streams).__name__}")
    if not 1 <= streams <= 12:
        raise ValueError(f"multi_stream: streams must be in 1..12, got {streams}")
    return MultiStream(MultiStreamState(streams, inner.state), inner)
