"""Wire-level helpers shared by every hook: byte accounting, collectives, future chaining.

Every collective a hook issues goes through :func:`all_reduce`, :func:`reduce_scatter` or
:func:`all_gather` here, so the bytes are counted in one place and a failure names the rank,
the operation and the group. Futures are chained with :func:`after`, which never blocks a
worker thread (torch's own PowerSGD hook calls ``.wait()`` inside ``.then`` callbacks, which
occupies one of gloo's two worker threads per bucket in flight).
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Batch", "CommError", "Link", "Traffic", "after", "gloo_timeout"]

Future = torch.futures.Future

# torch >= 2.12 renamed the tensor collectives; the GPU machines run 2.11.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommError(RuntimeError):
    """A collective issued by an aiak.comm hook failed (peer died, timeout, bad input)."""


# The longest timeout accepted: a year. gloo keeps it in milliseconds and timedelta refuses
# values past ~2.7e6 years, so larger numbers (1e20, inf) could only overflow somewhere deeper.
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0


def gloo_timeout() -> datetime.timedelta:
    """The collective timeout from ``GLOO_TIMEOUT_SECONDS`` (default 60 s, as Perseus)."""
    raw = os.environ.get("GLOO_TIMEOUT_SECONDS", "").strip()
    if not raw:
        return datetime.timedelta(seconds=60)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 1e-3 <= seconds <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise ValueError(
            "GLOO_TIMEOUT_SECONDS must be a number of seconds from 0.001 to "
            f"{MAX_TIMEOUT_SECONDS:.0f} (a year), got {raw!r}"
        )
    return datetime.timedelta(seconds=seconds)


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


def new_future(t: torch.Tensor) -> Future:
    # A CUDA-aware future records an event on the current stream at set_result.
    return Future(devices=[t.device]) if t.device.type == "cuda" else Future()


class Pending:
    """A future to hand to DDP, completed later with a value or an error.

    torch's ``Future.set_exception`` stores the exception as the future's *value*; DDP's C++
    wait then fails with "Unable to cast <exception> to Tensor", losing the type. Here the
    future DDP holds is ``then`` of a trigger: an error is raised inside that callback, which
    makes it a real error of the future (DDP's backward re-raises it, type and message).
    ``future`` makes that ``then``; ``lazy()`` instead leaves it to the next stages (one
    ``then`` for the whole chain, see :class:`Lazy`).
    """

    __slots__ = ("_error", "_future", "_like", "_trigger")

    def __init__(self, like: torch.Tensor) -> None:
        self._like = like
        self._error: BaseException | None = None
        self._trigger = new_future(like)
        self._future: Future | None = None

    @property
    def future(self) -> Future:
        if self._future is None:
            self._future = self._trigger.then(self._unwrap)
        return self._future

    def lazy(self) -> Lazy:
        return Lazy(self._trigger, (self._check,), None)

    def _unwrap(self, f: Future) -> Any:
        return self._check(f.value())

    def _check(self, value: Any) -> Any:
        if self._error is not None:
            raise self._error
        return value

    def set_result(self, value: Any) -> None:
        self._trigger.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        self._error = exc
        self._trigger.set_result(self._like)


# The C++ methods themselves: torch.futures.Future's Python wrappers add a call each.
_then = torch._C.Future.then
_value = torch._C.Future.value


class Lazy:
    """A future not made yet: a real ``base`` future and the stages to apply to its value.

    :func:`after` on a Lazy appends a stage instead of making another future, so a bucket's
    chain (collective -> value -> decode, ...) becomes one C++ ``then`` where a real future
    is needed: handed to DDP (:func:`real`), or chained to a stage that returns futures. On
    CUDA every ``then`` takes a pooled stream, waits for and records events and re-enters
    Python; the stages run in order in one callback, on one stream, so their kernels stay
    ordered as before.
    """

    __slots__ = ("base", "stages", "what")

    def __init__(
        self,
        base: Future,
        stages: tuple[Callable[[Any], Any], ...],
        what: Callable[[], str] | None,
    ) -> None:
        self.base, self.stages, self.what = base, stages, what

    def future(self) -> Future:
        stages, what = self.stages, self.what

        def run(f: Future) -> Any:
            try:
                value = _value(f)
            except BaseException as exc:
                if what is None:
                    raise
                raise CommError(f"{what()}: {exc}") from exc
            for fn in stages:
                value = fn(value)
            return value

        return _then(self.base, run)


def real(fut: Future | Lazy) -> Future:
    """A real future for ``fut`` (made here when it is a :class:`Lazy`)."""
    return fut.future() if isinstance(fut, Lazy) else fut


def after(
    fut: Future | Lazy,
    fn: Callable[[Any], Any],
    like: torch.Tensor,
    what: Callable[[], str] | None = None,
    chain: bool = False,
) -> Future:
    """A future for ``fn(fut.value())``.

    ``chain=False``: ``fn`` returns a value; the result is a :class:`Lazy` that becomes
    ``fut.then(...)`` when made real (C++: on NCCL, whose futures complete at enqueue, the
    callback runs inline on a side stream that waits for the collective). ``chain=True``:
    ``fn`` may return a future (a further stage), which is flattened into the result.
    Exceptions from ``fut`` (wrapped in :class:`CommError` with the text ``what()`` makes,
    built only then) or from ``fn`` propagate to the returned future, so DDP's wait raises
    instead of hanging.
    """
    if not chain:
        if isinstance(fut, Lazy):
            if what is None:
                return Lazy(fut.base, (*fut.stages, fn), fut.what)
            fut = fut.future()
        return Lazy(fut, (fn,), what)

    fut = real(fut)
    out = Pending(like)

    def forward(g: Future) -> None:
        try:
            out.set_result(g.value())
        except BaseException as exc:
            out.set_exception(exc)

    def callback(f: Future) -> None:
        try:
            value = f.value()
        except BaseException as exc:
            out.set_exception(CommError(f"{what()}: {exc}") if what else exc)
            return
        try:
            result = fn(value)
        except BaseException as exc:
            out.set_exception(exc)
            return
        if isinstance(result, Lazy):
            result = result.future()
        # ``Future.then`` returns the C++ base class, not a torch.futures.Future.
        if isinstance(result, torch._C.Future):
            result.add_done_callback(forward)
        else:
            out.set_result(result)

    fut.add_done_callback(callback)
    return out.future


def done(t: torch.Tensor) -> Future:
    fut = new_future(t)
    fut.set_result(t)
    return fut


def _describe(op: str, t: torch.Tensor, link: Link) -> Callable[[], str]:
    """The error text for a failed collective, built only when one fails (f-strings and
    ``get_rank`` per bucket were host time on DDP's critical path)."""

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
    2 x H200 ProcessGroupNCCL's enqueue took 100-190 µs per call (benchmarks/results/
    comm_nccl_notes.md), which on a host-bound step is step time. ``allreduce_coalesced`` puts
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
    # gloo's reduce-scatter has no future (torch 2.13: "Work::getFuture not implemented");
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


class SubBucket:
    """A bucket-like view handed to an inner hook: a buffer and per-parameter views into it.

    Real :class:`torch.distributed.GradBucket` objects cannot be built from Python; inner
    hooks only call ``buffer``, ``gradients``, ``parameters``, ``index`` and ``is_last``.
    ``views=None``: the parent's layout over ``buffer``, made on the first ``gradients()``
    call (most hooks never make it: list building per bucket was host time on DDP's critical
    path); parameters likewise come from the parent when asked for.
    """

    __slots__ = (
        "_buffer",
        "_index",
        "_is_last",
        "_params",
        "_parent",
        "_views",
        "batch",
        "step",
        "wire_ok",
    )

    def __init__(
        self,
        buffer: torch.Tensor,
        views: list[torch.Tensor] | None,
        parent: Any,
        params: list[torch.Tensor] | None = None,
        step: int | None = None,
    ) -> None:
        # ``step``: the top-level hook's step number, so inner hooks decide per step alike on
        # every rank even when they run in callbacks.
        self._buffer = buffer
        self._views = views
        self._parent = parent
        self._params = params
        # the top-level hook's Batch when it coalesces buckets (leaf allreduces hold there)
        self.batch: Batch | None
        # True only for the bucket DDP handed to the top-level hook (never inherited): its
        # future may carry the averaged wire tensor itself, narrower but of the same length,
        # because DDP copies the result into the gradients with a cast (see _Cast.reduce).
        self.wire_ok = False
        if type(parent) is SubBucket:  # fields, not calls: host time per bucket
            self.step = parent.step if step is None else step
            self.batch, self._index, self._is_last = parent.batch, parent._index, parent._is_last
        else:
            self.step = step if step is not None else getattr(parent, "step", 0)
            self.batch = getattr(parent, "batch", None)
            self._index = parent.index()
            self._is_last = parent.is_last()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        if self._views is None:
            src = self._parent.buffer()
            views = self._parent.gradients()
            if self._buffer.data_ptr() != src.data_ptr():
                views = _mirror(views, src, self._buffer)
            self._views = views
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        if self._params is None:
            self._params = list(self._parent.parameters())
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buffer = t


def _mirror(views: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> list[torch.Tensor]:
    """``views`` of ``src`` re-made over ``dst`` (same length): same offsets, sizes and strides
    (DDP's bucket views keep each parameter's strides, channels_last included)."""
    base = dst.storage_offset() - src.storage_offset()
    return [dst.as_strided(v.size(), v.stride(), v.storage_offset() + base) for v in views]


def rebase(bucket: Any, buffer: torch.Tensor) -> SubBucket:
    """The same layout as ``bucket`` over another buffer of the same length (a cast copy)."""
    return SubBucket(buffer, None, bucket, step=getattr(bucket, "step", None))


def shard_views(bucket: Any, start: int, shard: torch.Tensor) -> SubBucket:
    """Views of ``shard`` (elements ``[start, start+len)`` of the bucket) cut along rows.

    Each parameter's part of the shard is split into a partial first row, whole rows (a 2-D
    view a layer-wise compressor such as PowerSGD can factorise) and a partial last row; the
    padding past the bucket's end is one more 1-D view, so the views cover the shard exactly.
    """
    end = start + shard.numel()
    views: list[torch.Tensor] = []

    def piece(a: int, b: int) -> None:  # absolute bucket offsets -> 1-D view of the shard
        if b > a:
            views.append(shard[a - start : b - start])

    off = 0
    for g in bucket.gradients():
        n = g.numel()
        lo, hi = max(off, start), min(off + n, end)
        if lo < hi:
            cols = n // g.shape[0] if g.dim() > 0 and g.shape[0] > 0 else 1
            r0, r1 = -(-(lo - off) // cols), (hi - off) // cols
            if r1 > r0:
                piece(lo, off + r0 * cols)
                body = shard[off + r0 * cols - start : off + r1 * cols - start]
                views.append(body.view(r1 - r0, cols))
                piece(off + r1 * cols, hi)
            else:
                piece(lo, hi)
        off += n
    piece(max(off, start), end)
    return SubBucket(shard, views, bucket)


def keep(*tensors: torch.Tensor) -> None:
    """Tell the caching allocator that ``tensors`` are used on the current stream.

    Callbacks run on side streams; a tensor made on the hook's stream, read in a callback and
    then freed would otherwise be handed to the next allocation on its own stream (the next
    bucket's wire buffer, say) while the callback's kernel may not have read it yet."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(_current_stream(t.get_device()))


_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def _current_stream(device: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` from a cache: its Python layers cost ~25 µs per
    call on the H100 machine's host (cProfile), paid per bucket. Callback streams come from
    torch's fixed per-device pools, so the cache stays small."""
    key = torch._C._cuda_getCurrentStream(device)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(
            stream_id=key[0], device_index=key[1], device_type=key[2]
        )
    return stream


def resume(fn: Callable[[], Any], t: torch.Tensor) -> Callable[[Any], Any]:
    """``fn`` to run later in a callback; on CUDA it first waits for the work queued so far
    on the current stream (the gradients of ``t``), which the callback's stream has not seen."""
    if t.device.type != "cuda":
        return lambda _: fn()
    event = torch.cuda.Event()
    event.record()

    def run(_: Any) -> Any:
        torch.cuda.current_stream().wait_event(event)
        return fn()

    return run
