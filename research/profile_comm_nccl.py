"""Where a comm hook's time goes in a DDP step on NCCL (one host, 2+ GPUs).

    torchrun --nproc_per_node 2 research/profile_comm_nccl.py [--layers 12] [--out DIR]

For each hook: median step time; host time spent inside the hook call per bucket (DDP calls
hooks on the autograd thread, so on a model whose backward is short on the GPU that time is on
the critical path); multi-tensor table builds per step (each one a pinned upload); and, from
one profiled step, the CUDA runtime calls that can stall the host (synchronisations, pinned
allocations). Rank 0 writes ``profile_<mode>.txt`` (torch.profiler tables) under ``--out``
and prints a summary table last.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from aiak import comm
from aiak.comm import _collectives, _offload
from aiak.comm import cast as comm_cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_comm_nccl import _model, _sync, setup  # the same model, set-up and sync

try:
    from aiak.ops import _mta
except ImportError:  # aiak.ops absent: nothing to count
    _mta = None

STALLS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMallocHost",
    "cudaMalloc",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "cuLaunchKernel",
)


class Counters:
    def __init__(self) -> None:
        self.host_s: list[float] = []
        self.builds = 0
        # aiak's worker thread (offloaded hooks): per bucket, seconds queued and running
        self.queued_s: list[float] = []
        self.run_s: list[float] = []
        self.phase_s: dict[str, list[float]] = {}


PHASES = (
    (_collectives, "all_reduce_mean"),
    (comm_cast.Cast, "encode"),
    (comm_cast.Cast, "decode_"),
)


def _time_phases(counters: Counters) -> Callable[[], None]:
    """Wrap the hook phases in PHASES with timers; returns the function that unwraps them."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in PHASES]
    for owner, name, fn in saved:

        def timed(*a: Any, _fn: Callable = fn, _name: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                counters.phase_s.setdefault(_name, []).append(time.perf_counter() - t)

        setattr(owner, name, timed)

    def undo() -> None:
        for owner, name, fn in saved:
            setattr(owner, name, fn)

    return undo


def _timing_submit(real_submit: Callable, counters: Counters) -> Callable:
    """aiak.comm._offload.submit, timing each bucket's wait in the queue and its run on the
    worker thread (which torch.profiler does not trace)."""

    def submit(run: Callable, bucket: Any) -> torch.futures.Future:
        t_submit = time.perf_counter()

        def timed_run(b: Any) -> torch.futures.Future:
            t_start = time.perf_counter()
            fut = run(b)
            counters.queued_s.append(t_start - t_submit)
            counters.run_s.append(time.perf_counter() - t_start)
            return fut

        return real_submit(timed_run, bucket)

    return submit


def _timed(hook: Callable, counters: Counters) -> Callable:
    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        t0 = time.perf_counter()
        fut = hook(state, bucket)
        counters.host_s.append(time.perf_counter() - t0)
        return fut

    # DDP checks the annotations as objects (this module's are strings).
    timed.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    timed.__name__ = timed.__qualname__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    return timed


def _modes() -> dict[str, Callable]:
    """name -> function(ddp, counters) registering the (timed) hook."""

    def torch_hook(fn: Callable) -> Callable:
        return lambda ddp, c: ddp.register_comm_hook(None, _timed(fn, c))

    def aiak(factory: Callable[[], comm.CommHook]) -> Callable:
        def register(ddp: Any, c: Counters) -> None:
            hook = factory()
            names = {p: n for n, p in ddp.module.named_parameters()}
            hook.setup(hook.state, ddp.process_group, names)
            ddp.register_comm_hook(hook.state, _timed(hook, c))

        return register

    return {
        "no hook": lambda ddp, c: None,
        "torch allreduce": torch_hook(default_hooks.allreduce_hook),
        "torch fp16": torch_hook(default_hooks.fp16_compress_hook),
        "torch bf16": torch_hook(default_hooks.bf16_compress_hook),
        "aiak allreduce": aiak(comm.allreduce),
        "aiak fp16": aiak(lambda: comm.fp16_compress(scale=10)),
        "aiak nan_check": aiak(comm.nan_check),
        "aiak powersgd r4": aiak(lambda: comm.powersgd(rank=4, start_iter=2)),
        "aiak bf16": aiak(comm.bf16_compress),
    }


def _run(name: str, register: Callable, args: Any, device: torch.device, x, y) -> dict:
    counters = Counters()
    ddp = torch.nn.parallel.DistributedDataParallel(_model(args.layers, device))
    register(ddp, counters)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    backward_s: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        t0 = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        opt.step()

    real_submit = _offload.submit
    _offload.submit = _timing_submit(real_submit, counters)
    undo_phases = _time_phases(counters)
    build = _mta._build if _mta is not None else None
    if _mta is not None:

        def counting_build(*a: Any, **k: Any) -> Any:
            counters.builds += 1
            return build(*a, **k)

        _mta._build = counting_build
    try:
        for _ in range(5):
            step()
        _sync(device)
        counters.host_s.clear()
        counters.queued_s.clear()
        counters.run_s.clear()
        counters.phase_s.clear()
        counters.builds = 0
        backward_s.clear()
        times = []
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        calls = len(counters.host_s)
        row = {
            "mode": name,
            "step_ms": statistics.median(times),
            "backward_host_ms": statistics.median(backward_s) * 1e3,
            "buckets": calls // args.steps,
            "hook_host_us_per_bucket": (sum(counters.host_s) / max(calls, 1)) * 1e6,
            "table_builds_per_step": counters.builds / args.steps,
            "worker_queued_us": statistics.median(counters.queued_s) * 1e6
            if counters.queued_s
            else 0.0,
            "worker_run_us": statistics.median(counters.run_s) * 1e6 if counters.run_s else 0.0,
            "phases": " ".join(
                f"{k}={statistics.median(v) * 1e6:.0f}us" for k, v in counters.phase_s.items()
            ),
        }
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                step()
            _sync(device)
        if dist.get_rank() == 0 and args.out and name in args.trace.split(","):
            # Per-thread timelines (autograd thread, aiak's worker, NCCL), for chrome://tracing.
            trace = Path(args.out) / f"trace_{name.replace(' ', '_')}.json"
            prof.export_chrome_trace(str(trace))
            with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        events = prof.key_averages()
        stalls = {e.key: (e.count / 2, e.cpu_time_total / 2e3) for e in events if e.key in STALLS}
        row["stalls"] = "; ".join(f"{k} x{n:g} {ms:.2f}ms" for k, (n, ms) in sorted(stalls.items()))
        if dist.get_rank() == 0 and args.out:
            path = Path(args.out) / f"profile_{name.replace(' ', '_').strip('[]')}.txt"
            path = path.with_name(path.name.replace("[", "").replace("]", ""))
            with path.open("w") as f:
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=40))
                f.write("\n\n")
                if device.type == "cuda":
                    f.write(events.table(sort_by="self_cuda_time_total", row_limit=25))
        return row
    finally:
        _offload.submit = real_submit
        undo_phases()
        if build is not None:
            _mta._build = build
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="", help="comma-separated subset of the mode names")
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--trace", default="", help="comma-separated modes to export traces of")
    args = p.parse_args()
    device, x, y = setup()
    modes = _modes()
    if device.type != "cuda":
        modes.pop("torch bf16")  # torch refuses its bf16 hook off NCCL
    if args.modes:
        modes = {k: v for k, v in modes.items() if k in args.modes.split(",")}
    rows = [_run(name, reg, args, device, x, y) for name, reg in modes.items()]
    if dist.get_rank() == 0:
        base = rows[0]["step_ms"]
        print(f"{'mode':<24} {'step ms':>8} {'+ms':>6} {'bwd host':>8} {'bkts':>4} "
              f"{'hook us/bkt':>11} {'builds':>6} {'wq us':>6} {'wrun us':>7}  "
              "stalls (per step)")  # fmt: skip
        for r in rows:
            print(
                f"{r['mode']:<24} {r['step_ms']:8.2f} {r['step_ms'] - base:6.2f} "
                f"{r['backward_host_ms']:8.2f} {r['buckets']:4d} "
                f"{r['hook_host_us_per_bucket']:11.1f} {r['table_builds_per_step']:6.1f} "
                f"{r['worker_queued_us']:6.0f} {r['worker_run_us']:7.0f}  {r['stalls']}"
            )
            if r["phases"]:
                print(f"{'':<24} phases (median per call): {r['phases']}")
    comm.exit_rank(0)


if __name__ == "__main__":
    raise SystemExit(main())
