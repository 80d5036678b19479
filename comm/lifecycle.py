"""Ending a rank cleanly: :func:`shutdown` and :func:`exit_rank`.

Why this is needed. gloo completes collectives on its own worker threads, and those threads
run Python: ``then`` callbacks (aiak's hooks and torch's own chain them), and the release of
tensors and callables whose last reference the finished work held. Two exits go wrong:

- the last reference to a gloo process group is dropped while this thread holds the GIL (a
  DDP model's C++ reducer freed after ``destroy_process_group()``): the group's destructor
  joins its worker threads, one of which waits for the GIL to release a tensor, and the process
  deadlocks;
- the interpreter finalises while a worker thread still runs Python (groups still held by a
  DDP model or a hook state at exit): Python ends the thread, the forced unwind meets C++
  that cannot unwind, and the process aborts ("terminate called without an active exception").

So before a group is destroyed nothing of ours may hold it, and no collective may still be
finishing. :func:`shutdown` drains aiak's worker thread, waits for and releases every hook
state's groups and futures, detaches every live DDP model from its process group (reducer,
logger, hooks), clears the topology's cached groups, collects garbage, meets the other ranks
in a barrier (after it, every rank's collectives are complete), and only then destroys the
process groups. A group that torch itself still holds from C++ (DDP's construction keeps one
in torch 2.13) then lives on with idle threads, which neither deadlock nor abort at exit.
:func:`exit_rank` is the hard exit for processes that exist only to compute and report (aiak's
conformance ranks, test workers, benchmarks): after shutdown and flushed output it ends the
process without the interpreter's teardown, where other libraries' threads could still race it.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import _offload
from ._futures import CommError
from .env import rank_label
from .topology import forget as _forget_topology

__all__ = ["exit_rank", "shutdown"]

logger = logging.getLogger("aiak.comm")

_lock = threading.Lock()
_SHUT = "_aiak_comm_shut_down"


def _closed_forward(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "aiak.comm.shutdown: this DistributedDataParallel model was shut down (its process "
        "group is gone); call its .module directly or build a new DDP model"
    )


def _ddp_models(extra: Iterable[Any]) -> list[torch.nn.parallel.DistributedDataParallel]:
    ddp_type = torch.nn.parallel.DistributedDataParallel
    found: dict[int, Any] = {}
    for m in extra:
        if not isinstance(m, ddp_type):
            raise TypeError(
                f"shutdown: models must be DistributedDataParallel, got {type(m).__name__}"
            )
        found[id(m)] = m
    # Every live DDP model holds its group through its C++ reducer; one left alive would drop
    # the last reference later, holding the GIL (the deadlock above).
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some proxies warn on
        if issubclass(type(obj), ddp_type):
            found.setdefault(id(obj), obj)
    return list(found.values())


def _wait_future(fut: Any, deadline: float, what: str) -> None:
    while not fut.done():
        if time.monotonic() > deadline:
            raise CommError(f"aiak.comm.shutdown: {what} did not complete in time")
        time.sleep(0.001)


def _release_model(model: torch.nn.parallel.DistributedDataParallel, deadline: float) -> None:
    if model.__dict__.get(_SHUT):
        return
    for _hook, state in getattr(model, "_comm_hooks", ()) or ():
        stack = [state]
        while stack:
            s = stack.pop()
            tail = getattr(s, "_tail", None)
            if tail is not None:
                _wait_future(tail, deadline, f"rank {_rank()}: a bucket of {type(s).__name__}")
            release = getattr(s, "release", None)
            if release is not None:
                release()
            children = getattr(s, "children", None)
            stack.extend(children() if children is not None else ())
    # The reducer (and the logger that holds it) keep the group alive from C++: drop them
    # while the world still holds the group, so this is not its last reference.
    for name in ("logger", "reducer", "_comm_hooks", "process_group"):
        model.__dict__.pop(name, None)
    model.__dict__["forward"] = _closed_forward
    model.__dict__[_SHUT] = True


def _rank() -> str:
    try:
        return str(dist.get_rank()) if dist.is_initialized() else rank_label()
    except Exception:  # a broken group still lets shutdown name the rank
        return rank_label()


def _timeout_seconds(timeout: float | None) -> float:
    if timeout is None:
        return 60.0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"shutdown: timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"shutdown: timeout must be a positive finite number, got {timeout!r}")
    return float(timeout)


def shutdown(
    *models: torch.nn.parallel.DistributedDataParallel,
    destroy: bool = True,
    barrier: bool = True,
    timeout: float | None = None,
) -> None:
    """End this rank's distributed work cleanly; idempotent; call it on every rank.

    - aiak's hook worker thread finishes what is queued and is joined;
    - every aiak hook state drops its process groups, links and pending futures (the state
      itself stays usable: pickle it, or register it again after a new ``init_process_group``);
    - ``models`` and, when ``destroy``, every other live ``DistributedDataParallel`` model are
      detached from their process group: their ``.module`` stays intact, calling the DDP
      wrapper afterwards raises;
    - with ``destroy`` (default): a barrier with the other ranks (``barrier=False`` skips it,
      e.g. after a peer died), then ``torch.distributed.destroy_process_group()``.

    ``timeout`` (seconds, default 60) bounds each wait; a rank that does not arrive makes the
    barrier raise naming this rank instead of hanging.
    """
    seconds = _timeout_seconds(timeout)
    if not isinstance(destroy, bool) or not isinstance(barrier, bool):
        raise TypeError("shutdown: destroy and barrier must be bools")
    with _lock:
        deadline = time.monotonic() + seconds
        _offload.stop(seconds)
        targets = _ddp_models(models) if destroy else list(models)
        if not destroy:
            _ddp_models(models)  # type checks only
        for m in targets:
            _release_model(m, deadline)
        del targets
        _forget_topology()
        gc.collect()
        if not destroy or not dist.is_initialized():
            return
        if barrier and dist.get_world_size() > 1:
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
                else:
                    dist.barrier()
            except Exception as exc:
                raise CommError(
                    f"aiak.comm.shutdown: rank {_rank()}: the barrier before destroying the "
                    f"process group failed ({type(exc).__name__}: {exc}); a peer died or "
                    "did not call shutdown"
                ) from exc
        distributed_c10d.destroy_process_group()  # torch's own, even where activation wraps it
        gc.collect()


def exit_rank(code: int = 0, timeout: float | None = None) -> None:
    """Shut down (:func:`shutdown`, if the process group is still up), flush stdout, stderr
    and logging, and end the process with ``code`` without the interpreter's teardown.

    For processes that only compute and report: their results must be written (and closed)
    before this call. ``atexit`` handlers do not run.
    """
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise ValueError(f"exit_rank: code must be an int in [0, 255], got {code!r}")
    try:
        if dist.is_initialized():
            shutdown(timeout=timeout)
        else:
            _offload.stop(_timeout_seconds(timeout))
    except BaseException as exc:  # report, then still end with a failure code
        print(f"aiak.comm.exit_rank: rank {_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = code or 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream has nothing left to flush
            stream.flush()
    os._exit(code)
