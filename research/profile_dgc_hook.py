"""Where the per-bucket DGC hook's host time goes, on one GPU (NCCL, world 1).

    python research/profile_dgc_hook.py [--ratio 0.001] [--top 25]

ResNet-50's 161 parameter shapes in DDP's default buckets (``benchmarks/bench_dgc_hook.py``'s
set-up), a trivial loss: a step is the backward's hooks. Prints the host time of the backward
with the plain allreduce and with the DGC hook, then one profiled DGC step's host-side events
sorted by self CPU time (``--top``), and the synchronising CUDA API calls, if any. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
            for _ in range(10):
                hosts.append(step())
                torch.cuda.synchronize()
            hosts.sort()
            print(f"{name}: backward host ms {hosts[5] * 1e3:.2f} (min {hosts[0] * 1e3:.2f})")
            if name != "dgc":
                continue
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                step()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            print(
                ev.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=56)
            )
    finally:
        comm.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
