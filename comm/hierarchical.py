"""Two-level allreduce (Horovod's hierarchical allreduce) as a composable hook.

N nodes x G ranks, a bucket of S bytes: intra-node reduce-scatter (each rank then holds S/G),
allreduce of that shard among the ranks with the same local rank on every node through the
``outer`` hook (any hook: fp16, PowerSGD, ...), intra-node allgather. Per node, the slow link
then carries ~2(N-1)/N * S each way instead of ~2(NG-1)/NG * S for a flat ring
(N=2, G=2: 1.0 S vs 1.5 S; G=4: 1.0 S vs 1.75 S). A length not divisible by G is zero-padded.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from . import _buckets, _collectives, _futures, _streams
from ._base import CommHook, HookState, Setup, check_hook
from ._collectives import Link
from .allreduce import Allreduce, allreduce
from .cast import Cast

__all__ = ["HierarchicalState", "hierarchical"]


class HierarchicalState(HookState):
    __slots__ = ("_inter", "_intra", "_mode", "fallback", "inner", "outer")

    def __init__(self, inner: HookState, outer: HookState, fallback: str) -> None:
        super().__init__()
        self.inner = inner  # wire format of the intra-node stage (allreduce or a cast)
        self.outer = outer  # the inter-node hook
        self.fallback = fallback  # heterogeneous nodes: "flat" (warn) or "raise"
        self._intra: Link | None = None
        self._inter: Link | None = None
        self._mode = ""  # set up: "two-level", "intra" (one node), "inter" (one rank/node), "flat"

    def children(self) -> tuple[HookState, ...]:
        return (self.inner, self.outer)


class _Hierarchical(CommHook):
    __slots__ = ("inner", "outer")
    defers = True  # two levels: the outer and allgather stages start in callbacks

    def __init__(self, state: HierarchicalState, inner: CommHook, outer: CommHook) -> None:
        super().__init__(state)
        self.inner, self.outer = inner, outer

    def deferring(self, state: HierarchicalState) -> bool:
        # One level (one node, one rank per node, or flat): the stage's hook launches directly.
        # Serialising buckets there would hold each launch until the previous bucket is done.
        if state._mode == "intra":
            return self.inner.deferring(state.inner)
        if state._mode in ("inter", "flat"):
            return self.outer.deferring(state.outer)
        return True

    def syncing(self) -> bool:
        return self.inner.syncing() or self.outer.syncing()

    def setup_tree(self, state: HierarchicalState, ctx: Setup) -> None:
        topo = ctx.topo
        world = tuple(range(dist.get_world_size()))
        if tuple(ctx.candidates[ctx.mine]) != world:
            raise ValueError(
                "hierarchical: must run over the whole world group (put multi_stream or "
                f"other wrappers inside it, as outer=...), got ranks {ctx.candidates[ctx.mine]}"
            )
        if not topo.homogeneous:
            sizes = [len(n) for n in topo.nodes]
            msg = f"hierarchical: nodes have different numbers of ranks {sizes}"
            if state.fallback == "raise":
                raise ValueError(msg + "; pass fallback='flat' to run flat instead")
            warnings.warn(msg + "; running the outer hook flat over all ranks", stacklevel=2)
            state._mode = "flat"
            self.outer.setup_tree(state.outer, ctx)
            return
        node = topo.node_of[topo.rank]
        intra_sets = list(topo.nodes)
        inter_sets = [topo.inter_ranks(i) for i in range(topo.local_size)]
        for ranks in intra_sets + inter_sets:  # every rank creates every group, same order
            topo.group(ranks)
        state._intra = topo.link(intra_sets[node])
        state._inter = topo.link(inter_sets[topo.local_rank])
        state._mode = (
            "intra" if topo.num_nodes == 1 else "inter" if topo.local_size == 1 else "two-level"
        )
        self.inner.setup_tree(state.inner, ctx.below(intra_sets, node))
        self.outer.setup_tree(state.outer, ctx.below(inter_sets, topo.local_rank))

    def reduce(self, state: HierarchicalState, bucket: Any, link: Link) -> torch.futures.Future:
        if state._mode == "flat":
            return self.outer.reduce(state.outer, bucket, link)
        if state._mode == "intra":
            return self.inner.reduce(state.inner, bucket, state._intra)
        if state._mode == "inter":
            return self.outer.reduce(state.outer, bucket, state._inter)
        intra, inter = state._intra, state._inter
        buf = bucket.buffer()
        g = intra.size
        shard_len = -(-buf.numel() // g)
        start = intra.ranks.index(dist.get_rank()) * shard_len
        wire = self.inner.encode(state.inner, buf, shard_len * g)
        wire_shard = wire.new_empty(shard_len)

        def outer_stage(_: Any) -> torch.futures.Future:
            shard = buf.new_empty(shard_len)
            _streams.keep(wire_shard)
            self.inner.decode_(state.inner, wire_shard, shard).div_(g)  # intra sum -> mean
            fut = self.outer.reduce(state.outer, _buckets.shard_views(bucket, start, shard), inter)
            return _futures.after(fut, lambda _: gather_stage(shard), buf, chain=True)

        def gather_stage(shard: torch.Tensor) -> torch.futures.Future:
            _streams.keep(shard)
            part = self.inner.encode(state.inner, shard, shard_len)
            full = wire if wire.data_ptr() != buf.data_ptr() else buf
            fut = _collectives.all_gather(full, part, intra, state.inner.traffic)

            def decode(_: Any) -> torch.Tensor:
                _streams.keep(full)
                return self.inner.decode_(state.inner, full, buf)

            return _futures.after(fut, decode, buf)

        fut = _collectives.reduce_scatter(wire_shard, wire, intra, state.inner.traffic)
        return _futures.after(fut, outer_stage, buf, chain=True)


def hierarchical(
    inner: CommHook | None = None, outer: CommHook | None = None, fallback: str = "flat"
) -> CommHook:
    """Intra-node reduce-scatter, inter-node ``outer`` on the shard, intra-node allgather.

    ``inner`` sets the intra-node wire format: ``None``/``allreduce()`` (fp32) or
    ``fp16_compress(...)``/``bf16_compress(...)`` (these stages are a reduce-scatter and an
    allgather, which only plain and cast formats define). ``outer`` is any hook (default
    ``allreduce()``). Nodes come from ``GROUP_RANK``/``LOCAL_WORLD_SIZE`` or hostnames; with
    nodes of different sizes, ``fallback="flat"`` runs ``outer`` over all ranks with a warning,
    ``"raise"`` raises. One node: ``inner`` alone; one rank per node: ``outer`` alone.
    """
    inner = allreduce() if inner is None else inner
    outer = allreduce() if outer is None else outer
    check_hook("hierarchical", "inner", inner)
    check_hook("hierarchical", "outer", outer)
    if type(inner) not in (Allreduce, Cast) or (
        isinstance(inner, Cast) and type(inner.inner) is not Allreduce
    ):
        raise TypeError(
            "hierarchical: inner must be allreduce(), fp16_compress() or bf16_compress() "
            "(the intra-node stage is a reduce-scatter + allgather in that format); put other "
            f"hooks in outer=, got {inner.__name__}"
        )
    if fallback not in ("flat", "raise"):
        raise ValueError(f"hierarchical: fallback must be 'flat' or 'raise', got {fallback!r}")
    return _Hierarchical(HierarchicalState(inner.state, outer.state, fallback), inner, outer)
