"""Where the per-bucket DGC hook's host time goes, on one GPU (NCCL, world 1).

    python research/profile_dgc_hook.py [--ratio 0.001] [--top 25]

ResNet-50's 161 parameter shapes in DDP's default buckets (``benchmarks/bench_dgc_hook.py``'s
set-up), a trivial loss: a step is the backward's hooks. Prints the host time of the backward
with the plain allreduce and with the DGC hook, then per hook: cudaMalloc calls of the caching
allocator over the timed steps (``num_device_alloc``), host syncs torch reports in one step
(``set_sync_debug_mode``), the Python functions with the most host time over 5 steps
(cProfile, ``--top``), one profiled step's kernels by GPU time and (DGC) its host-side events by
self CPU time; last, whether a small non-blocking copy to the GPU waits for the stream, from
pageable and from page-locked memory (:func:`h2d_probe`). Needs a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_dgc_hook

from aiak.conformance.shapes import resnet50_shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    from aiak import comm

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("nccl")
    shapes = resnet50_shapes()
    weights = [torch.randn(s, device=dev) for s in shapes]
    try:
        for name in ("allreduce", "dgc"):
            ddp = nn.parallel.DistributedDataParallel(bench_dgc_hook.Shapes(shapes).to(dev))
            if name == "dgc":
                comm.register(ddp, comm.dgc(compress_ratio=a.ratio))

            def step(ddp=ddp) -> float:
                ddp.zero_grad(set_to_none=False)
                t = time.perf_counter()
                ddp(weights).backward()
                return time.perf_counter() - t

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            hosts = []
            mallocs = torch.cuda.memory_stats()["num_device_alloc"]
            for _ in range(10):
                hosts.append(step())
                torch.cuda.synchronize()
            mallocs = torch.cuda.memory_stats()["num_device_alloc"] - mallocs
            hosts.sort()
            print(f"{name}: backward host ms {hosts[5] * 1e3:.2f} (min {hosts[0] * 1e3:.2f})")
            print(f"{name}: cudaMalloc calls in 10 steps: {mallocs}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            syncs = [str(w.message).splitlines()[0] for w in caught]
            print(f"{name}: host syncs in one step: {len(syncs)} {syncs[:3]}")
            prof_py = cProfile.Profile()
            prof_py.enable()
            for _ in range(5):
                step()
            prof_py.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(a.top)
            print(f"{name}: cProfile, 5 steps, by own time\n{text.getvalue()}")
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                step()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            print(f"{name}: one step's kernels by GPU time")
            by_gpu = ev.table(sort_by="self_device_time_total", row_limit=15)
            print(by_gpu)
            if name == "dgc":
                print(
                    ev.table(
                        sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=56
                    )
                )
        h2d_probe(dev)
    finally:
        comm.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def h2d_probe(dev: torch.device) -> None:
    """Host ms of a 40-element int64 copy to the GPU, ``non_blocking=True``, from pageable and
    from page-locked memory, issued behind tens of ms of queued GPU work (``torch.cuda._sleep``):
    a copy that waits for the stream returns after that work, one that is queued returns at
    once. DGC's per-bucket sample starts are such a copy."""
    small = torch.arange(40, dtype=torch.int64)
    for label, src in (("pageable", small), ("pinned", small.pin_memory())):
        got = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)
            t = time.perf_counter()
            src.to(dev, non_blocking=True)
            got.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        torch.cuda.synchronize()
        queued = (time.perf_counter() - t) * 1e3
        ms = ", ".join(f"{v:.3f}" for v in sorted(got))
        print(f"h2d probe, {label}: host ms per copy [{ms}] behind {queued:.1f} ms of work")


if __name__ == "__main__":
    main()
