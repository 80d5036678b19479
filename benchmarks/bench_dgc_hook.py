"""The DGC hook's host time and launches per step on ResNet-50's 161 gradient tensors.

One process, one DDP model whose parameters have ResNet-50's shapes (hard-coded: torchvision
is not needed) and a trivial loss, so a step is the backward's hooks plus the optimizer. Rows,
same gradients, same run:

* ``allreduce``: DDP's own allreduce (the floor);
* ``dgc per-tensor``: the previous hook, one ``aiak::dgc_select`` (and a dozen torch ops) per
  compressed tensor, written out here for this comparison only;
* ``dgc``: ``aiak.comm.dgc``, the multi-tensor path (a fixed number of torch calls per bucket),
  with ``cuda_graphs`` off; ``dgc graphs`` (CUDA): the same, each bucket's selection one CUDA
  graph replay (the default on CUDA).

Per row: host ms per step (the backward call returns, GPU not waited for), step ms
(synchronised), aten ops per step (a dispatch-mode count) and CUDA kernel launches per step
(profiler, CUDA only). The ratio printed is per-tensor / multi-tensor host time.

    python benchmarks/bench_dgc_hook.py                      # world 1, CUDA if present
    torchrun --nproc-per-node 2 benchmarks/bench_dgc_hook.py # world 2 (gloo on CPU)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision's ResNet-50 parameters, in its order: 161 tensors, 25.6 M elements."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, cin, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return [*shapes, (1000, 2048), (1000,)]


class Shapes(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, weights: list[torch.Tensor]) -> torch.Tensor:
        # d loss / d p = weights[i]: fixed gradients, almost no compute
        return sum((p * w).sum() for p, w in zip(self.ps, weights))


def per_tensor_hook(ratio: float):
    """The previous DGC hook's compression: a Python loop over the bucket's tensors."""
    from aiak.ops.dgc_select import dgc_select

    mem: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(_state, bucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        base, length, world = buf.storage_offset(), buf.numel(), dist.get_world_size()
        dense, vals, idxs = [], [], []
        gen = torch.Generator().manual_seed(bucket.index())
        for g in bucket.gradients():
            n, off = g.numel(), g.storage_offset() - base
            flat = buf[off : off + n]
            mmt, vec = mem.setdefault(
                (bucket.index(), off, n),
                (torch.zeros(n + 1, device=buf.device), torch.zeros(n + 1, device=buf.device)),
            )
            mmt[:n].mul_(0.9).add_(flat)
            if g.dim() <= 1:
                dense.append((off, mmt[:n].clone()))
                continue
            vec[:n].add_(mmt[:n])
            k = max(1, math.ceil(n * ratio))
            m = min(n, max(1, math.ceil(n * 0.01)))
            stride = max(1, n // m)
            start = int(torch.randint(0, stride, (1,), generator=gen))
            v, idx = dgc_select(vec[:n], k, m, start, stride, None, 1.3, 0.8, 10, True)
            dump = torch.where(idx < 0, n, idx)
            vec.index_fill_(0, dump, 0.0)
            mmt.index_fill_(0, dump, 0.0)
            vals.append(v)
            idxs.append(torch.where(idx < 0, length, idx + off))
        dbuf = torch.cat([t for _, t in dense])
        dist.all_reduce(dbuf)
        payload = torch.cat([torch.cat(idxs).view(torch.uint8), torch.cat(vals).view(torch.uint8)])
        out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
        dist.all_gather_into_tensor(out, payload)
        nib = sum(v.numel() for v in vals) * 8
        rows = out.view(world, -1)
        acc = torch.zeros(length + 1, device=buf.device)
        acc.index_add_(
            0,
            rows[:, :nib].reshape(-1).view(torch.int64),
            rows[:, nib:].reshape(-1).view(torch.float32),
        )
        buf.copy_(acc[:length].div_(world))
        o = 0
        for off, t in dense:
            buf[off : off + t.numel()].copy_(dbuf[o : o + t.numel()] / world)
            o += t.numel()
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    # DDP checks the return annotation as an object (this module's annotations are strings)
    hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    return hook


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(name: str, args, device: torch.device, shapes, weights) -> dict:
    from aiak import comm

    model = Shapes(shapes).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    hook = None
    if name.startswith("dgc") and name != "dgc per-tensor":
        hook = comm.dgc(compress_ratio=args.ratio)
        hook.state.cuda_graphs = name == "dgc graphs"
        comm.register(ddp, hook)
    elif name == "dgc per-tensor":
        ddp.register_comm_hook(None, per_tensor_hook(args.ratio))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> float:
        ddp.zero_grad(set_to_none=False)
        t = time.perf_counter()
        ddp(weights).backward()
        host = time.perf_counter() - t
        return host

    for _ in range(args.warmup):  # DDP rebuilds its buckets after the first step
        step()
    sync()
    hosts, steps = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        hosts.append(step())
        sync()
        steps.append(time.perf_counter() - t)
    with _Count() as count:
        step()
    sync()
    launches = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        launches = sum(e.count for e in prof.key_averages() if e.key in _LAUNCHES)
    if name == "dgc graphs" and not hook.state.cuda_graphs:
        name = "dgc graphs FAILED (ran eager)"
    return {
        "mode": name,
        "host_ms": statistics.median(hosts) * 1e3,
        "step_ms": statistics.median(steps) * 1e3,
        "aten_ops": count.n,
        "cuda_launches": launches,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--csv", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:  # world 1 without a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        shapes = resnet50_shapes()
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        weights = [torch.randn(s, generator=gen).to(device) for s in shapes]
        names = ["allreduce", "dgc per-tensor", "dgc"]
        if device.type == "cuda":
            names.append("dgc graphs")
        rows = [measure(name, args, device, shapes, weights) for name in names]
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) != 0:
        return 0
    by = {r["mode"]: r for r in rows}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"DGC hook, ResNet-50's {len(shapes)} tensors, {name}, world {os.environ['WORLD_SIZE']}")
    print(f"{'mode':>16} {'host ms':>9} {'step ms':>9} {'aten ops':>9} {'CUDA launches':>14}")
    for r in rows:
        launches = "" if r["cuda_launches"] is None else r["cuda_launches"]
        print(
            f"{r['mode']:>16} {r['host_ms']:>9.2f} {r['step_ms']:>9.2f} {r['aten_ops']:>9} "
            f"{launches:>14}"
        )
    for name in names[2:]:
        if name not in by:
            continue
        ratio = by["dgc per-tensor"]["host_ms"] / by[name]["host_ms"]
        print(f"host time per step, per-tensor / {name}: {ratio:.2f}x")
    if args.csv:
        from _harness import append_csv

        world = os.environ["WORLD_SIZE"]
        append_csv("dgc_hook", [{**r, "device": name, "world": world} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
