"""Run hooks' Python off DDP's autograd thread: one FIFO worker thread per process.

DDP calls a comm hook on the autograd thread, between launching the backward kernels of one
layer and the next. A hook that waits for the GPU on the host (``nan_check`` reads a flag per
bucket) stalls those launches for as long as the GPU takes to reach the bucket; on the worker
the wait costs the backward nothing (12 x Linear(4096) on 2 x H200: +1.75 ms vs +2.35 ms
inline). For hooks that do not wait, the thread hand-offs (a GIL hand-off per torch call) cost
more than their Python saves the autograd thread (fp16: +0.48 vs +0.26 ms), so they stay inline
unless asked (``comm.register(..., offload=True)``); ``research/comm_nccl_notes.md``.

With offloading, the hook only records an event on the current stream (the bucket's gradients
are ready there) and queues the bucket; a worker thread runs the hook on a side stream that
waits for that event, and completes the future DDP holds when the hook's own future completes.
The worker's Python runs while the autograd thread launches the next layers (torch ops release
the GIL). The single queue keeps buckets, and so collectives, in the order DDP produced them,
which is the same on every rank: the order gloo and NCCL match collectives by.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._futures import CommError, Pending
from .env import rank_label

__all__ = ["stop", "submit"]

Future = torch.futures.Future

_queue: queue.SimpleQueue = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_streams: dict[int, torch.cuda.Stream] = {}


def submit(run: Callable[[Any], Future], bucket: Any) -> Future:
    """Queue ``run(bucket)`` for the worker; returns a future that completes with its result.

    Called on the autograd thread; ``run`` must return a future (a hook's future). Any
    exception ``run`` raises, or its future carries, is set on the returned future, so DDP's
    wait raises it instead of hanging.
    """
    buf = bucket.buffer()
    ready = None
    if buf.is_cuda:
        ready = torch.cuda.Event()
        ready.record()  # the gradients in the bucket are written on this (current) stream
    out = Pending(buf)
    _ensure_worker()
    _queue.put((run, bucket, ready, out))
    return out.future


def _ensure_worker() -> None:
    global _thread, _atexit_registered
    if _thread is not None and _thread.is_alive():
        return
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_work, name="aiak-comm-hooks", daemon=True)
            _thread.start()
            if not _atexit_registered:  # once per process, however often the worker restarts
                atexit.register(_drain)
                _atexit_registered = True


DRAIN_SECONDS = 30.0
_atexit_registered = False


def stop(timeout: float = DRAIN_SECONDS) -> None:
    """Let the worker finish what is queued, then end it and join it (``aiak.comm.shutdown``).

    Idempotent; the next offloaded bucket starts a new worker. Raises ``CommError`` naming the
    rank when the worker is still busy after ``timeout`` seconds.
    """
    global _thread
    with _lock:
        thread = _thread
        if thread is None or not thread.is_alive():
            _thread = None
            return
        _queue.put(None)
        thread.join(timeout=timeout)
        if thread.is_alive():
            raise CommError(
                f"aiak.comm: rank {rank_label()}: the hook worker thread did not"
                f" finish its queued buckets within {timeout:g} s"
            )
        _thread = None


def _drain() -> None:
    """At exit, let the worker finish what is queued (bounded), then stop it: a daemon thread
    killed inside torch's C++ aborts the interpreter ("terminate called without an active
    exception")."""
    try:
        stop(DRAIN_SECONDS)
    except CommError as exc:
        print(f"aiak.comm: {exc}", file=sys.stderr)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def _work() -> None:
    while True:
        item = _queue.get()
        if item is None:  # _drain at exit
            return
        run, bucket, ready, out = item
        try:
            if ready is None:
                fut = run(bucket)
            else:
                device = bucket.buffer().device
                stream = _side_stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    fut = run(bucket)
            fut.add_done_callback(lambda f, out=out: _forward(f, out))
        except BaseException as exc:  # never let the worker die: DDP would wait forever
            out.set_exception(exc)


def _forward(fut: Future, out: Pending) -> None:
    # Runs where ``fut`` completes (inline on NCCL, on a side stream that waits for it), so a
    # CUDA-aware ``out`` records its completion after everything the hook queued.
    try:
        out.set_result(fut.value())
    except BaseException as exc:
        out.set_exception(exc)
