"""Multi-tensor apply, and the device tables' cache (every cache of ``ops/``, with its key and
why, is listed in docs/ops.md "Caches").

apex and torch pack up to ~110 tensor addresses into each launch's 4 KB argument buffer and
launch again for the rest. Here the addresses, sizes and chunk map of the whole set live in one
small int64 device tensor instead (layout at the top of ``kernels/mta_common.cuh``), so any
number of tensors takes one launch with ``grid = number of chunks``.

The tables' cache: ``_cache`` maps a key to the :class:`Table` of a tensor set an
op has validated. Key: the op's name and, per list, the tensors' addresses, sizes, dtypes and
devices, all contiguous (:func:`key`, one C++ call: ``ops/_host.py``). A hit therefore means
"this op checked this exact set before"; a set with a non-contiguous tensor has no key and is
never cached. A bound optimizer step (``ops/_fused.py``) and ``BoundNorm`` keep the table they
got from here and the key of their last launch, and compare only the key per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import torch

from aiak.ops import _cuda, _host

CHUNK = _cuda.defines("mta_common.cuh")["CHUNK"]  # elements per block
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CACHE_SIZE = 256  # tables kept per process (each a few KB)


@dataclasses.dataclass(frozen=True)
class Table:
    """A device table for ``depth`` aligned tensor lists of ``num_tensors`` tensors each."""

    data: torch.Tensor  # int64, on the device
    depth: int
    num_tensors: int
    num_chunks: int
    ready: torch.cuda.Event  # recorded after the upload, on `stream`
    stream: int
    dtypes: frozenset = frozenset()
    scratches: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def wait(self) -> None:
        """Order the current stream after the table's upload (only needed across streams).

        Skipped while capturing a CUDA graph: waiting there on an event recorded outside the
        capture is illegal, and ``torch.cuda.graph`` synchronises the device before capturing,
        so a table built during warm-up is complete by then.
        """
        if _cuda.raw_stream(self.data.get_device()) == self.stream:
            return  # the usual case, without building a Stream object (3-5 µs)
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.data.device).wait_event(self.ready)

    def scratch(self, words: int) -> torch.Tensor:
        """A zeroed int64 workspace of ``words`` words for a kernel over this table on the
        current stream, kept per stream: launches on one stream run in order, so they can
        share one; kernels that count in it (tickets) set it back to zero when they finish.
        While a CUDA graph is being captured a fresh one is made (captured with its zeroing),
        so graphs replayed on other streams never share a workspace."""
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(words, dtype=torch.int64, device=self.data.device)
        stream = _cuda.raw_stream(self.data.get_device())
        found = self.scratches.get(stream)
        if found is None or found.numel() < words:
            found = torch.zeros(words, dtype=torch.int64, device=self.data.device)
            self.scratches[stream] = found
        return found


_cache: dict[tuple, Table] = {}
# Least recently used goes first: a hit stamps its table (id -> tick) instead of reordering the
# cache, which would hash and compare the key a second time (5-8 µs on 161 tensors); the
# oldest stamp is searched only when an insertion overflows the cache.
_used: dict[int, int] = {}
_tick = itertools.count()
_lock = threading.Lock()


def key(tag: str, lists: Sequence[Sequence[torch.Tensor]]) -> tuple | None:
    """The cache key of ``lists`` for op ``tag``, or None when the set is not cacheable (a
    tensor that is not contiguous, an item that is not a tensor): see :func:`_host.layout_key`.
    ``tag`` separates ops, so a hit also means "this op has validated this exact set before"."""
    layout = _host.layout_key(lists)
    return None if layout is None else (tag, layout)


def lookup(k: tuple) -> Table | None:
    """The cached table for key ``k`` (ordered after its upload on this stream), or None."""
    with _lock:
        found = _cache.get(k)
        if found is not None:
            _used[id(found)] = next(_tick)
    if found is not None:
        found.wait()
    return found


def cached(tag: str, lists: Sequence[Sequence[torch.Tensor]]) -> Table | None:
    """The table of a set op ``tag`` has validated before, or None (validate, then
    :func:`table`)."""
    k = key(tag, lists)
    return None if k is None else lookup(k)


def table(lists: Sequence[Sequence[torch.Tensor]], device: torch.device, tag: str = "") -> Table:
    """The device table for ``lists`` (aligned lists of dense tensors on ``device``), built
    and cached on first use.

    Tensors of list 0 set the sizes; the caller has checked that every list has the same
    length, the same numel per position, supported dtypes and dense layouts.
    """
    k = key(tag, lists)
    found = None if k is None else lookup(k)
    if found is not None:
        return found
    built = build(lists, device)
    if k is not None:
        with _lock:
            replaced = _cache.get(k)  # another thread built the same set meanwhile
            if replaced is not None:
                _used.pop(id(replaced), None)
            _cache[k] = built
            _used[id(built)] = next(_tick)
            if len(_cache) > CACHE_SIZE:
                oldest = min(_cache, key=lambda kk: _used[id(_cache[kk])])
                del _used[id(_cache.pop(oldest))]
    return built


def build(lists: Sequence[Sequence[torch.Tensor]], device: torch.device) -> Table:
    """A new table for ``lists`` (not cached)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "aiak multi-tensor op: this tensor set was first seen during CUDA graph capture, "
            "where its address table cannot be uploaded; run the op once before capturing"
        )
    numels, ptrs, dtypes = _host.parts(lists)
    codes = tuple(tuple(DTYPE_CODES[d] for d in ds) for ds in dtypes)
    return _build(numels[0], ptrs, codes, device, frozenset(itertools.chain(*dtypes)))


def _build(
    numels: tuple[int, ...], ptrs: tuple, codes: tuple, device: torch.device, dtypes: frozenset
) -> Table:
    depth, n = len(ptrs), len(numels)
    counts = [(m + CHUNK - 1) // CHUNK for m in numels]
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    chunks = [(t << 32) | k for t, c in enumerate(counts) for k in range(c)]
    words: list[int] = []
    for p in ptrs:
        # Addresses above 2**63 do not occur on CUDA; int64 holds them unchanged.
        words.extend(p)
    for c in codes:
        words.extend(c)
    words.extend(numels)
    words.extend(first)
    words.extend(chunks)
    # Pinned memory and a non-blocking copy: a new tensor set costs no host synchronisation
    # (torch's pinned allocator keeps the host buffer until the copy has run).
    host = torch.tensor(words, dtype=torch.int64).pin_memory()
    data = host.to(device, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(stream)
    return Table(data, depth, n, first[-1], ready, stream.cuda_stream, dtypes)


def clear_cache() -> None:
    """Forget every cached table (tests; or after freeing many parameter sets)."""
    with _lock:
        _cache.clear()
        _used.clear()


def cache_info() -> dict[str, int]:
    with _lock:
        return {"tables": len(_cache), "max": CACHE_SIZE}
