"""Node topology: which rank lives on which node, and the process groups built from it.

The node of a rank comes from torchrun's ``GROUP_RANK`` (checked against ``LOCAL_WORLD_SIZE``)
or, failing that, the hostname; every rank publishes its key with one tensor ``all_gather``.
Groups are created once per process and cached on the :class:`Topology` (``new_group`` must be
called by every rank in the same order, so each is made for every node, not only ours).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._collectives import Link
from .env import gloo_timeout, local_world_size, node_key

__all__ = ["Topology", "topology"]


class Topology:
    """Nodes of the world group. ``node_of[r]`` is the node index of global rank ``r``."""

    __slots__ = ("_groups", "local_rank", "node_of", "nodes", "rank", "source")

    def __init__(self, keys: Sequence[str], rank: int, local_world_size: int | None = None):
        if not keys:
            raise ValueError("Topology: keys must name the node of at least one rank")
        if not 0 <= rank < len(keys):
            raise ValueError(f"Topology: rank {rank} out of range for {len(keys)} ranks")
        order: dict[str, int] = {}
        for k in keys:
            order.setdefault(k, len(order))
        self.node_of = tuple(order[k] for k in keys)
        self.nodes = tuple(
            tuple(r for r, n in enumerate(self.node_of) if n == i) for i in range(len(order))
        )
        if local_world_size is not None:
            for i, members in enumerate(self.nodes):
                if len(members) != local_world_size:
                    raise ValueError(
                        f"LOCAL_WORLD_SIZE={local_world_size} but node {i} ({keys[members[0]]})"
                        f" has {len(members)} ranks: {list(members)}; check GROUP_RANK"
                    )
        self.rank = rank
        self.local_rank = self.nodes[self.node_of[rank]].index(rank)
        self.source = keys[0].split(":", 1)[0]
        self._groups: dict[tuple[tuple[int, ...], int], Any] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def homogeneous(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_of[self.rank]])

    def inter_ranks(self, local_rank: int) -> tuple[int, ...]:
        """The ranks with ``local_rank`` on each node (the inter-node group of that shard)."""
        return tuple(node[local_rank] for node in self.nodes)

    def crosses(self, ranks: Sequence[int]) -> bool:
        """Whether this rank's ring successor in ``ranks`` sits on another node."""
        if self.rank not in ranks or len(ranks) < 2:
            return False
        i = list(ranks).index(self.rank)
        return self.node_of[ranks[(i + 1) % len(ranks)]] != self.node_of[self.rank]

    def group(self, ranks: Sequence[int], copy: int = 0) -> Any:
        """The process group over ``ranks`` (``copy`` > 0: an extra one for multi-stream).

        Collective: every rank must make the same calls in the same order.
        """
        key = (tuple(ranks), copy)
        if key not in self._groups:
            world = dist.get_world_size()
            if copy == 0 and len(ranks) == world and list(ranks) == list(range(world)):
                self._groups[key] = dist.group.WORLD
            else:
                self._groups[key] = dist.new_group(list(ranks), timeout=gloo_timeout())
        return self._groups[key]

    def link(self, ranks: Sequence[int], copy: int = 0, group: Any = None) -> Link:
        pg = group if group is not None else self.group(ranks, copy)
        return Link(pg, ranks, self.crosses(ranks))

    def __repr__(self) -> str:
        return f"Topology(nodes={[list(n) for n in self.nodes]}, rank={self.rank})"


_CACHE: dict[int, Topology] = {}
_KEY_BYTES = 512  # a hostname is at most 253 bytes


def _gather_keys(key: str) -> list[str]:
    """Every rank's ``key``, in rank order (a collective).

    Not ``all_gather_object``: it pickles through numpy, which torch does not require, so an
    install without numpy could not detect the topology.
    """
    data = key.encode()
    if not data or len(data) > _KEY_BYTES or b"\0" in data:
        raise ValueError(f"aiak.comm: node key {key!r} must be 1..{_KEY_BYTES} bytes without NUL")
    backend = str(dist.get_backend())
    on_gpu = "gloo" not in backend and torch.cuda.is_available()  # NCCL gathers GPU tensors
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mine = torch.zeros(_KEY_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    rows = torch.stack(out).cpu().tolist()  # one device-to-host copy, whatever the world size
    return [bytes(r).rstrip(b"\0").decode() for r in rows]


def forget() -> None:
    """Drop the cached topologies and the process groups they created (see ``shutdown``)."""
    _CACHE.clear()


def topology() -> Topology:
    """The world's topology, detected once per default process group (a collective)."""
    if not dist.is_initialized():
        raise RuntimeError("aiak.comm.topology: torch.distributed is not initialized")
    world = dist.group.WORLD
    key = id(world)
    if key not in _CACHE:
        keys = _gather_keys(node_key())
        lws = local_world_size()
        _CACHE.clear()  # a new default group: groups of the old one are gone
        _CACHE[key] = Topology(keys, dist.get_rank(), lws)
    return _CACHE[key]
