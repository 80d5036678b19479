"""Futures for DDP: chaining that never blocks a worker thread, and errors that keep their type.

Futures are chained with :func:`after`, which never blocks a worker thread (torch's own
PowerSGD hook calls ``.wait()`` inside ``.then`` callbacks, which occupies one of gloo's two
worker threads per bucket in flight). :class:`Lazy` folds a bucket's chain of stages into one
C++ ``then``; :class:`Pending` is a future completed later with a value or a real error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CommError", "Lazy", "Pending", "after", "all_of", "done", "new_future", "real"]

Future = torch.futures.Future


class CommError(RuntimeError):
    """A collective issued by an aiak.comm hook failed (peer died, timeout, bad input)."""


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


def all_of(futs: list[Future], like: torch.Tensor) -> Lazy:
    """A future of ``like`` done when every future of ``futs`` is; it fails with the first
    failure among them (its type kept, see :class:`Pending`).

    On CUDA its stages run on a stream that waited for every input's work. ``collect_all``'s
    own future is CPU-only (no events): a stage chained to it runs on whichever stream is
    current, which has not waited for the collectives (NCCL's run on NCCL's streams), so it
    could read an allgather's output before the allgather wrote it. Here the inputs' events
    join the current stream when they are all done (``wait`` on a done future blocks no thread:
    on CUDA it makes the current stream wait for the future's events), and the result's own
    event is recorded after them.
    """
    out = Pending(like)

    def settle(every: Future) -> None:
        try:
            for f in every.value():
                f.wait()  # done: re-raises its error; on CUDA, the current stream waits for it
        except BaseException as exc:
            out.set_exception(exc)
            return
        out.set_result(like)

    torch.futures.collect_all(futs).add_done_callback(settle)
    return out.lazy()
