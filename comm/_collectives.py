"""Collectives and byte accounting: every collective a hook issues goes through here.

:func:`all_reduce_mean`, :func:`reduce_scatter` and :func:`all_gather` count the bytes this
rank sends (:class:`Traffic`, split intra-/inter-node by the :class:`Link`) in one place, and a
failure names the rank, the operation and the group. :class:`Batch` holds allreduces back so
that consecutive buckets leave in one coalesced call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._futures import CommError, Future, Pending, after, done

__all__ = ["Batch", "Link", "Traffic", "all_gather", "all_reduce_mean", "reduce_scatter"]

# torch >= 2.12 names the tensor collectives ``*_single``; older releases have only the
# ``*_tensor`` / ``*_into_tensor`` names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Link:
    """A process group as seen from this rank: its ranks and whether our ring edge leaves the node.

    Bytes are counted under the ring schedule gloo and NCCL use for large tensors: each rank
    sends ``2(n-1)/n * B`` for an allreduce of ``B`` bytes and ``(n-1)/n * B`` for a
    reduce-scatter or an allgather, all to its successor in the group; they are inter-node
    bytes when that successor lives on another node.
    """

    __slots__ = ("_avg", "group", "inter", "ranks")

    def __init__(self, group: Any, ranks: Sequence[int], inter: bool) -> None:
        self.group = group
        self.ranks = tuple(ranks)
        self.inter = inter
        self._avg: bool | None = None  # the backend averages itself (NCCL); found on first use

    @property
    def native_avg(self) -> bool:
        """NCCL averages inside the collective (``ncclAvg``: each input pre-multiplied by
        1/n, so fp16 sums cannot overflow): no separate division pass, no extra launch."""
        if self._avg is None:
            self._avg = dist.get_backend(self.group) == "nccl"
        return self._avg

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Link(ranks={list(self.ranks)}, inter={self.inter})"


class Traffic:
    """Bytes this rank sent, split intra-/inter-node: for the current step and in total."""

    __slots__ = ("_lock", "inter", "inter_total", "intra", "intra_total")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # callbacks of several buckets run on gloo worker threads
        self.intra = self.inter = self.intra_total = self.inter_total = 0

    def add(self, link: Link, nbytes: int) -> None:
        with self._lock:
            if link.inter:
                self.inter += nbytes
                self.inter_total += nbytes
            else:
                self.intra += nbytes
                self.intra_total += nbytes

    def new_step(self) -> None:
        with self._lock:
            self.intra = self.inter = 0

    def __getstate__(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("inter", "inter_total", "intra", "intra_total")}

    def __setstate__(self, d: dict[str, int]) -> None:
        self._lock = threading.Lock()
        for k, v in d.items():
            setattr(self, k, v)


def _describe(op: str, t: torch.Tensor, link: Link) -> Callable[[], str]:
    """The error text for a failed collective, built only when one fails (f-strings and
    ``get_rank`` per bucket are host time on DDP's critical path)."""

    def text() -> str:
        rank = dist.get_rank() if dist.is_initialized() else -1
        return (
            f"aiak.comm: rank {rank}: {op} of {t.numel()} x {t.dtype} over ranks "
            f"{list(link.ranks)} failed (a peer died or GLOO_TIMEOUT_SECONDS passed?)"
        )

    return text


def _ring_bytes(nbytes: int, n: int, allreduce: bool) -> int:
    return (2 if allreduce else 1) * (n - 1) * nbytes // n


def all_reduce_mean(
    t: torch.Tensor, link: Link, traffic: Traffic, batch: Batch | None = None
) -> Future:
    """Average ``t`` in place over ``link``; divides first so fp16 sums do not overflow.

    With a ``batch``, the allreduce is held there and issued by its next ``flush`` together
    with the other held ones (one coalesced call per group and dtype)."""
    if link.size == 1:
        return done(t)
    traffic.add(link, _ring_bytes(t.numel() * t.element_size(), link.size, True))
    op = _mean_op(t, link)
    # The process group's own call, as DDP's reducer makes it: dist.all_reduce's Python checks
    # cost ~11 µs per call on a desktop CPU (pg.allreduce: 8 µs with gloo), paid per bucket on
    # DDP's critical path. Our groups are ours: the checks cannot fail here.
    direct = isinstance(link.group, dist.ProcessGroup) and not t.is_complex()
    if not direct:
        work = dist.all_reduce(t, op=op, group=link.group, async_op=True)
    elif batch is not None:
        return batch.hold(t, link, op)
    else:
        work = link.group.allreduce([t], _allreduce_options(op))
    return after(work.get_future(), lambda _: t, t, _describe("allreduce", t, link))


def _mean_op(t: torch.Tensor, link: Link) -> Any:
    if link.native_avg:
        return dist.ReduceOp.AVG
    t.div_(link.size)  # gloo has no AVG
    return dist.ReduceOp.SUM


class Batch:
    """Allreduces held back so that consecutive buckets leave in one coalesced call.

    A collective call costs the host the same whether it carries one bucket or several: on
    2 x H200 ProcessGroupNCCL's enqueue took 100-190 µs per call (research/comm_nccl_notes.md),
    which on a host-bound step is step time. ``allreduce_coalesced`` puts
    the held buckets in one NCCL group launch (gloo flattens them into one allreduce). Which
    buckets share a call must be the same on every rank, so the top-level hook flushes at
    fixed bucket indices, never on timing. The price: a held bucket starts its transfer one
    bucket later, so the last call of a step carries more bytes after the backward ends.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, Link, Any, Pending]] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, t: torch.Tensor, link: Link, op: Any) -> Future:
        pending = Pending(t)
        self._held.append((t, link, op, pending))
        return pending.lazy()

    def drop(self, why: str) -> None:
        """Forget held allreduces (a step that failed before its flush); their futures fail."""
        held, self._held = self._held, []
        for _, _, _, pending in held:
            pending.set_exception(CommError(f"aiak.comm: allreduce never issued: {why}"))

    def flush(self) -> None:
        """Issue what is held: one call per (group, dtype, op), in order of first appearance."""
        held, self._held = self._held, []
        calls: dict[tuple, list[tuple[torch.Tensor, Link, Any, Pending]]] = {}
        for entry in held:
            t, link, op, _ = entry
            calls.setdefault((id(link.group), t.dtype, t.device, op), []).append(entry)
        for entries in calls.values():
            tensors = [e[0] for e in entries]
            link, op = entries[0][1], entries[0][2]
            if len(tensors) == 1:
                work = link.group.allreduce(tensors, _allreduce_options(op))
            else:
                work = link.group.allreduce_coalesced(tensors, _coalesced_options(op))
            work.get_future().add_done_callback(_settle(entries))


def _settle(entries: list[tuple[torch.Tensor, Link, Any, Pending]]) -> Callable[[Future], None]:
    def settle(f: Future) -> None:
        try:
            f.value()
        except BaseException as exc:
            t, link = entries[0][0], entries[0][1]
            n = sum(e[0].numel() for e in entries)
            what = _describe(f"coalesced allreduce of {len(entries)} buckets", t, link)()
            for e in entries:
                e[3].set_exception(CommError(f"{what} ({n} elements in all): {exc}"))
            return
        for t, _, _, pending in entries:
            pending.set_result(t)

    return settle


_OPTIONS: dict[tuple[type, Any], Any] = {}


def _options(kind: type, op: Any) -> Any:
    """One options object per (kind, reduce op), made once: building it is host time."""
    opts = _OPTIONS.get((kind, op))
    if opts is None:
        opts = _OPTIONS[kind, op] = kind()
        opts.reduceOp = op
    return opts


def _allreduce_options(op: Any) -> Any:
    return _options(dist.AllreduceOptions, op)


def _coalesced_options(op: Any) -> Any:
    return _options(dist.AllreduceCoalescedOptions, op)


def reduce_scatter(out: torch.Tensor, src: torch.Tensor, link: Link, traffic: Traffic) -> Future:
    """Sum ``src`` over ``link``; this rank's ``len(out)`` slice lands in ``out``."""
    traffic.add(link, _ring_bytes(src.numel() * src.element_size(), link.size, False))
    what = _describe("reduce-scatter", src, link)
    if dist.get_backend(link.group) != "gloo":
        work = _reduce_scatter(out, src, group=link.group, async_op=True)
        return after(work.get_future(), lambda _: out, out, what)
    # gloo's reduce-scatter has no future ("Work::getFuture not implemented");
    # an all-to-all moves the same (n-1)/n bytes, and the n chunks are summed here.
    recv = torch.empty_like(src)
    work = dist.all_to_all_single(recv, src, group=link.group, async_op=True)
    return after(
        work.get_future(), lambda _: torch.sum(recv.view(link.size, -1), 0, out=out), out, what
    )


def all_gather(out: torch.Tensor, shard: torch.Tensor, link: Link, traffic: Traffic) -> Future:
    """Concatenate every rank's ``shard`` into ``out``."""
    traffic.add(link, _ring_bytes(out.numel() * out.element_size(), link.size, False))
    work = _all_gather(out, shard, group=link.group, async_op=True)
    return after(work.get_future(), lambda _: out, out, _describe("allgather", out, link))
