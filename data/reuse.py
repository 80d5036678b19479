"""CrossEpochLoader: worker processes that live across epochs and run ahead into the next one.

``DataLoader(persistent_workers=True)`` keeps its workers, but it only plans epoch e+1 when
``iter(loader)`` is called again: the workers sit idle from the moment the last batches of
epoch e are fetched until then, and the first step of e+1 waits for a whole batch to load (plus
a reset round trip to every worker). On small data sets with short epochs that bubble is most
of the time. This wrapper keeps one window of ``prefetch`` batches in flight at all times,
across the epoch boundary: while epoch e's last batches are consumed (and while the training
loop evaluates or saves between epochs) the workers already build epoch e+1's first batches.

Epoch e+1's order is planned early by calling ``set_epoch(e + 1)`` on the sampler (and on the
batch sampler) and materialising it, so the order is the one the plain ``DataLoader`` gives when
the sampler is seeded per epoch (``DistributedSampler``, ``BalancedDistributedSampler``, or a
sampler with its own ``generator``).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import random
import traceback
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers the reductions that share tensors through queues
from torch.utils.data import DataLoader, IterableDataset

from aiak.ops._args import check_float, check_int

__all__ = ["CrossEpochLoader"]

_POLL_S = 1.0  # how often a waiting side checks that the other side is still alive
_JOIN_S = 5.0  # how long close() waits for a worker before terminating it


class _RemoteError:
    """An exception raised in a worker, carried back with its formatted traceback."""

    def __init__(self, exc: BaseException, worker_id: int) -> None:
        # The type travels by reference: a class the parent cannot import (one defined inside
        # a function) would make this message unpicklable too, so it becomes a RuntimeError.
        self.exc_type: type[BaseException] = type(exc)
        try:
            pickle.loads(pickle.dumps(self.exc_type))
        except Exception:
            self.exc_type = RuntimeError
        self.text = (
            f"Caught {type(exc).__name__} in CrossEpochLoader worker {worker_id}.\n"
            f"Original {traceback.format_exc()}"
        )

    def reraise(self) -> None:
        try:
            err = self.exc_type(self.text)
        except Exception:  # an exception type whose constructor wants other arguments
            err = RuntimeError(self.text)
        raise err


def _worker_loop(
    dataset: Any,
    collate_fn: Any,
    auto_collation: bool,
    tasks: Any,
    results: Any,
    worker_id: int,
    seed: int,
    worker_init_fn: Any,
    parent: int,
) -> None:
    torch.set_num_threads(1)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    try:
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
    except Exception as e:
        results.put((None, _RemoteError(e, worker_id)))
        return
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the owner died without closing us
                return
            continue
        if task is None:
            # Results not yet read are of no use after shutdown: exit without waiting for the
            # queue's feeder thread to flush them into a pipe nobody reads any more.
            results.cancel_join_thread()
            return
        key, indices = task
        try:
            if auto_collation:
                batch: Any = collate_fn([dataset[i] for i in indices])
            else:
                batch = collate_fn(dataset[indices])
            # Pickled here, not by the queue's feeder thread: a batch the feeder cannot pickle
            # is printed to stderr and dropped, and the loop would wait for it forever.
            out: Any = bytes(ForkingPickler.dumps(batch))
            del batch
        except Exception as e:
            out = _RemoteError(e, worker_id)
        results.put((key, out))
        del task, out  # the worker's references to shared memory go with the batch


@dataclass
class _Epoch:
    serial: int
    number: int
    batches: list[Any]
    sent: int = 0
    ready: dict[int, Any] = field(default_factory=dict)


def _shutdown(workers: list[Any], tasks: Any, results: Any) -> None:
    """Stop every worker: a polite None each, then terminate what did not exit in time."""
    for _ in workers:
        with contextlib.suppress(Exception):  # a closed or broken queue: terminate below
            tasks.put_nowait(None)
    for w in workers:
        w.join(_JOIN_S)
    for w in workers:
        if w.is_alive():
            w.terminate()
            w.join(_JOIN_S)
        if w.is_alive():
            w.kill()
            w.join(_JOIN_S)
    # The workers are gone: read back what is left in the task pipe so this process's feeder
    # thread can flush and exit, then join it (bounded; it is a daemon thread either way).
    with contextlib.suppress(Exception):
        while True:
            tasks.get(timeout=0.05)
    for q in (tasks, results):
        q.cancel_join_thread()
        q.close()
    feeder = getattr(tasks, "_thread", None)
    if feeder is not None:
        feeder.join(_JOIN_S)


class CrossEpochLoader:
    """Wrap a ``DataLoader``: same dataset, sampler, collate, worker count; workers started
    once and kept for every epoch, with the next epoch's first batches prefetched.

    Args:
        loader: a map-style ``DataLoader`` with ``num_workers >= 1`` (its own iterator is
            never used; only its configuration).
        prefetch: batches kept in flight (produced or being produced, not yet consumed);
            default ``num_workers * prefetch_factor`` of ``loader``.
        start_epoch: the epoch number of the first ``iter()``.
        timeout: seconds to wait for one batch before ``RuntimeError`` (0: no limit; a dead
            worker is detected within a second either way).

    Each ``iter()`` runs the next epoch (``set_epoch`` overrides the number). Call
    ``loader.set_epoch(e)``, not the sampler's, if you set epochs yourself: the sampler of
    epoch e+1 is consulted before epoch e ends. Workers are stopped by ``close()``, by leaving
    a ``with`` block, when the object is collected, or at interpreter exit; a worker whose
    parent died exits within a second. Workers are seeded once from ``loader.generator``
    (or torch's RNG), like persistent workers, not re-seeded per epoch.
    """

    def __init__(
        self,
        loader: DataLoader,
        prefetch: int | None = None,
        start_epoch: int = 0,
        timeout: float = 0.0,
    ) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader must be a torch.utils.data.DataLoader, got {type(loader)}")
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError("loader: CrossEpochLoader needs a map-style dataset, not Iterable")
        if loader.num_workers < 1:
            raise ValueError("loader.num_workers must be >= 1 (the workers are what is reused)")
        if prefetch is None:
            prefetch = loader.num_workers * (loader.prefetch_factor or 2)
        op = "CrossEpochLoader"
        self.loader = loader
        self.prefetch = check_int("prefetch", prefetch, ge=1, op=op)
        self.timeout = check_float("timeout", timeout, ge=0, op=op)
        self._next_epoch = check_int("start_epoch", start_epoch, ge=0, op=op)
        self._epochs: deque[_Epoch] = deque()  # [current (being consumed),] next (prefetching)
        self._current: _Epoch | None = None
        self._serials = itertools.count()
        self._in_flight = 0
        self._closed = False

        ctx = loader.multiprocessing_context or mp.get_context()
        if isinstance(ctx, str):
            ctx = mp.get_context(ctx)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
        auto = loader.batch_sampler is not None
        self._workers = [
            ctx.Process(
                target=_worker_loop,
                args=(
                    loader.dataset,
                    loader.collate_fn,
                    auto,
                    self._tasks,
                    self._results,
                    i,
                    seed + i,
                    loader.worker_init_fn,
                    os.getpid(),
                ),
                daemon=True,
            )
            for i in range(loader.num_workers)
        ]
        for w in self._workers:
            w.start()
        # Runs on close(), on garbage collection and at interpreter exit, whichever is first;
        # it holds the workers and queues, not self, so it does not keep self alive.
        self._finalizer = weakref.finalize(
            self, _shutdown, self._workers, self._tasks, self._results
        )

    # -- public ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def workers(self) -> list[Any]:
        """The worker processes (for inspection; they are owned by this object)."""
        return list(self._workers)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` runs; a prefetched plan for another epoch is dropped."""
        self._next_epoch = check_int("epoch", epoch, ge=0, op="CrossEpochLoader.set_epoch")
        last = self._epochs[-1] if self._epochs else None
        if last is not None and last is not self._current and last.number != self._next_epoch:
            self._epochs.pop()

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("CrossEpochLoader is closed")
        if self._current is not None and self._epochs and self._epochs[0] is self._current:
            self._epochs.popleft()  # an unfinished epoch is abandoned; late results dropped
        self._current = None
        if not self._epochs or self._epochs[0].number != self._next_epoch:
            self._epochs.clear()
            self._plan(self._next_epoch)
        epoch = self._epochs[0]
        self._current = epoch
        self._next_epoch = epoch.number + 1
        return self._run(epoch)

    def close(self) -> None:
        """Stop and join every worker (terminating any that does not exit within 5 s)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> CrossEpochLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _plan(self, number: int) -> _Epoch:
        loader = self.loader
        for s in (loader.sampler, loader.batch_sampler):
            if s is not None and hasattr(s, "set_epoch"):
                s.set_epoch(number)
        source = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        epoch = _Epoch(next(self._serials), number, list(source))
        self._epochs.append(epoch)
        return epoch

    def _fill(self) -> None:
        """Send tasks until ``prefetch`` batches are in flight or ready, across one boundary."""
        while self._in_flight + sum(len(e.ready) for e in self._epochs) < self.prefetch:
            target = next((e for e in self._epochs if e.sent < len(e.batches)), None)
            if target is None:
                if len(self._epochs) >= 2 or self._current is None:
                    return  # the next epoch is planned and fully sent
                if self._epochs and self._epochs[-1].number != self._next_epoch - 1:
                    return
                target = self._plan(self._next_epoch)
                if not target.batches:
                    return
            self._tasks.put(((target.serial, target.sent), target.batches[target.sent]))
            target.sent += 1
            self._in_flight += 1

    def _receive(self) -> None:
        """Block for one result and file it under its epoch (results of dropped plans vanish)."""
        waited = 0.0
        while True:
            try:
                key, payload = self._results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                dead = [w for w in self._workers if not w.is_alive()]
                if dead:
                    self.close()
                    codes = ", ".join(f"pid {w.pid} exit code {w.exitcode}" for w in dead)
                    raise RuntimeError(
                        f"CrossEpochLoader worker(s) exited unexpectedly: {codes}"
                    ) from None
                if self.timeout and waited >= self.timeout:
                    raise RuntimeError(
                        f"CrossEpochLoader timed out after {self.timeout} s"
                    ) from None
        if key is None:  # worker_init_fn failed: the worker is gone
            self.close()
            payload.reraise()
        self._in_flight -= 1
        serial, index = key
        if isinstance(payload, bytes):
            try:
                payload = ForkingPickler.loads(payload)
            except Exception as e:
                raise RuntimeError(
                    f"CrossEpochLoader: a batch from a worker could not be unpickled here: {e!r}"
                ) from e
        for e in self._epochs:
            if e.serial == serial:
                e.ready[index] = payload
                return

    def _run(self, epoch: _Epoch) -> Iterator[Any]:
        for index in range(len(epoch.batches)):
            if self._current is not epoch:
                return  # a newer iter() took over
            while index not in epoch.ready:
                self._fill()  # dropped results of an abandoned plan free window slots
                self._receive()
            batch = epoch.ready.pop(index)
            if index == len(epoch.batches) - 1:
                # The epoch is fully received: drop it so the next epoch's window opens now.
                self._epochs.remove(epoch)
                self._fill()
            if isinstance(batch, _RemoteError):
                batch.reraise()
            yield batch
        if epoch in self._epochs:
            self._epochs.remove(epoch)
        self._fill()
