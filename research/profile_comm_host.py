"""Host time of a comm hook per bucket, collectives replaced by completed futures.

    python research/profile_comm_host.py [--device cpu|cuda] [--calls 2000]

DDP calls a hook on the autograd thread; when the backward is short on the GPU (12 x
Linear(4096) on 2 x H200: 2.3 ms of host time per backward without a hook) every microsecond
of the hook's Python lands on the step (research/profile_comm_nccl.py measures that on NCCL).
This isolates the hook's own Python: ``dist.all_reduce`` returns an already completed future,
as NCCL's does (it completes at enqueue), so callbacks run inline as they do there. One
process, no process group, no network; on CUDA the kernel launches and CUDA-aware futures are
real. Rows run the hooks inline (``offload=False``) except the last, which times what the
autograd thread pays when the hook runs on aiak's worker thread: the enqueue.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from aiak import comm
from aiak.comm import _collectives, _futures


class FakeBucket:
    """What hooks read from a ``dist.GradBucket``: one flat buffer and its per-param views."""

    def __init__(
        self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int = 0, n: int = 1
    ) -> None:
        self._buffer = buffer
        self._index, self._last = index, index == n - 1
        self._views, off = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            self._views.append(buffer[off : off + n].view(s))
            off += n
        self._params = [torch.nn.Parameter(v.detach().clone()) for v in self._views]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buffer = t


class _Work:
    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def get_future(self) -> torch.futures.Future:
        fut = _futures.new_future(self._t)
        fut.set_result([self._t])
        return fut

    def wait(self) -> bool:
        return True


def _fake_all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> _Work:
    return _Work(t)


class FakeGroup(dist.ProcessGroup):
    """A 2-rank process group whose allreduce completes at once (NCCL's futures complete at
    enqueue too), so hooks take their real size > 1 path without a peer."""

    def __init__(self) -> None:
        super().__init__(0, 2)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return _Work(tensors[0])


def _time(
    fn: Callable[[FakeBucket], Any],
    buckets: list[FakeBucket],
    steps: int,
    sync: Callable[[], None],
) -> float:
    """Median host µs per bucket call over ``steps`` steps of one call per bucket, the device
    synchronised between steps as in a training step (the GPU never holds the host back)."""
    for _ in range(3):
        for b in buckets:
            fn(b).wait()
    sync()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for b in buckets:
            fn(b)
        samples.append((time.perf_counter() - t0) / len(buckets) * 1e6)
        sync()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--buckets", type=int, default=12, help="distinct buckets per step")
    p.add_argument("--numel", type=int, default=4096 * 4096, help="elements per bucket")
    p.add_argument("--profile", default="", help="cProfile this row (its name) and print it")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    group = FakeGroup()
    link = _collectives.Link(group, (0, 1), inter=False)
    link._avg = device.type == "cuda"  # as NCCL would (gloo: divide, then sum)
    real_all_reduce = dist.all_reduce
    dist.all_reduce = _fake_all_reduce  # torch's hooks call it
    try:
        n = args.buckets
        buckets = [
            FakeBucket(torch.randn(args.numel, device=device), [(args.numel,)], i, n)
            for i in range(n)
        ]
        results: dict[str, float] = {}
        timed = _profiled(args.profile)
        for name, hook in (
            ("torch allreduce_hook", default_hooks.allreduce_hook),
            ("torch fp16_compress_hook", default_hooks.fp16_compress_hook),
        ):
            results[name] = timed(name, lambda b, h=hook: h(group, b), buckets, args.steps, sync)
        for name, factory, offload in (
            ("aiak allreduce", comm.allreduce, False),
            ("aiak fp16_compress()", comm.fp16_compress, False),
            ("aiak fp16_compress(scale=10)", lambda: comm.fp16_compress(scale=10), False),
            ("aiak nan_check(allreduce)", comm.nan_check, False),
            ("aiak fp16, offloaded: enqueue only", lambda: comm.fp16_compress(scale=10), True),
        ):
            hook = factory()
            state = hook.state
            state.offload = offload
            state._link, state._ready, state._serial = link, True, hook.deferring(state)
            _propagate_link(state, link)
            results[name] = timed(
                name, lambda b, h=hook, s=state: h(s, b), buckets, args.steps, sync
            )
    finally:
        dist.all_reduce = real_all_reduce
    width = max(map(len, results))
    print(
        f"host µs per bucket call ({device.type}, {n} buckets of {args.numel} elements, "
        "collectives faked)"
    )
    for name, us in results.items():
        print(f"  {name:<{width}}  {us:8.1f}")
    return results


def _profiled(row: str) -> Callable[..., float]:
    """``_time``, under cProfile for the row named ``row`` (its top functions printed)."""

    def timed(name: str, *args: Any) -> float:
        if name != row:
            return _time(*args)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        try:
            return _time(*args)
        finally:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)

    return timed


def _propagate_link(state: comm.HookState, link: _collectives.Link) -> None:
    """Wrappers hand their own link down; nothing else of setup is needed for flat hooks."""
    for child in state.children():
        child._link, child._ready = link, True
        _propagate_link(child, link)


if __name__ == "__main__":
    main()
