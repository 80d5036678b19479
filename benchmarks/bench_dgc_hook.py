"""The DGC hook's host time, aten ops and launches per step on ResNet-50's 161 gradient tensors.

One process, world 1 (NCCL on a GPU, gloo on the CPU), one DDP model whose parameters have
ResNet-50's shapes (hard-coded: torchvision is not needed) in DDP's default buckets, and a
trivial loss, so a step is the backward's hooks. Rows, same gradients, same run:

* ``allreduce``: DDP's own allreduce (the floor);
* ``dgc per-tensor``: the previous hook, a Python loop over each bucket's tensors with a dozen
  torch ops and one ``aiak::dgc_select`` per compressed tensor (kept here, and only here, as the
  baseline);
* ``dgc per-bucket``: ``aiak.comm.dgc``, a fixed number of torch calls per bucket (one
  ``aiak::dgc_segments_select`` for all its compressed tensors).

Per row: host ms per step (the backward call's return, the GPU not waited for), step ms
(synchronised), aten ops per step (a dispatch-mode count), CUDA kernel launches and GPU ms per
step (profiler, CUDA only). The ratios printed are per-tensor / per-bucket and per-bucket /
allreduce host time.

    python benchmarks/bench_dgc_hook.py            # CUDA if present, else CPU
    python benchmarks/bench_dgc_hook.py --quick    # CPU smoke run: narrow shapes, 2 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aiak.conformance.shapes import resnet50_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Shapes(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, weights: list[torch.Tensor]) -> torch.Tensor:
        # d loss / d p = weights[i]: fixed gradients, almost no compute
        return sum((p * w).sum() for p, w in zip(self.ps, weights))


def per_tensor_hook(ratio: float, sample_ratio: float = 0.01, momentum: float = 0.9):
    """The previous DGC hook's exchange, for this comparison only: per tensor, momentum
    correction in per-parameter memory, one ``aiak::dgc_select`` (strided samples, a random
    start drawn on the host), masking; then one dense allreduce and one allgather per bucket."""
    from aiak.ops.dgc_select import dgc_select

    mem: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    steps = [0]

    def hook(_state, bucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        base, length, world = buf.storage_offset(), buf.numel(), dist.get_world_size()
        if bucket.index() == 0:
            steps[0] += 1
        gen = torch.Generator().manual_seed(steps[0] * 7919 + bucket.index())
        dense, vals, idxs = [], [], []
        for g in bucket.gradients():
            n, off = g.numel(), g.storage_offset() - base
            flat = buf[off : off + n]
            sparse = g.dim() > 1
            size = n + 1 if sparse else n
            key = (bucket.index(), off, n)
            if key not in mem:
                mem[key] = (
                    torch.zeros(size, device=buf.device),
                    torch.zeros(size, device=buf.device),
                )
            mmt, vec = mem[key]
            body = mmt[:n]
            body.mul_(momentum).add_(flat)
            if not sparse:
                dense.append((off, body))
                continue
            vec[:n].add_(body)
            k = min(n, max(1, math.ceil(n * ratio)))
            if k >= n:
                v, idx = vec[:n].clone(), torch.arange(n, device=buf.device)
            else:
                m = min(n, max(1, math.ceil(n * sample_ratio)))
                stride = max(1, n // m)
                start = int(torch.randint(0, stride, (1,), generator=gen))
                v, idx = dgc_select(vec[:n], k, m, start, stride, None, 1.3, 0.8, 10, True)
            dump = torch.where(idx < 0, n, idx)
            vec.index_fill_(0, dump, 0.0)
            mmt.index_fill_(0, dump, 0.0)
            vals.append(v)
            idxs.append(torch.where(idx < 0, length, idx + off))
        if dense:
            dbuf = torch.cat([t.reshape(-1) for _, t in dense]).div_(world)
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
            buf[off : off + t.numel()].copy_(dbuf[o : o + t.numel()])
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
    ddp = nn.parallel.DistributedDataParallel(model)  # DDP's default buckets (25 MB)
    if name == "dgc per-bucket":
        comm.register(ddp, comm.dgc(compress_ratio=args.ratio))
    elif name == "dgc per-tensor":
        ddp.register_comm_hook(None, per_tensor_hook(args.ratio))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> float:
        ddp.zero_grad(set_to_none=False)
        t = time.perf_counter()
        ddp(weights).backward()
        return time.perf_counter() - t

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
    launches = gpu_ms = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in _LAUNCHES)
        gpu_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3
    return {
        "mode": name,
        "host_ms": statistics.median(hosts) * 1e3,
        "step_ms": statistics.median(steps) * 1e3,
        "aten_ops": count.n,
        "cuda_launches": launches,
        "gpu_ms": gpu_ms,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: widths / 8, 2 steps")
    p.add_argument("--csv", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    shrink = 1
    if args.quick:
        args.device, args.steps, args.warmup, args.csv, shrink = "cpu", 2, 2, False, 8
        args.ratio = max(args.ratio, 0.01)  # narrow tensors: keep more than one entry each
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        shapes = resnet50_shapes(shrink)
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(s, generator=gen).to(device) for s in shapes]
        names = ["allreduce", "dgc per-tensor", "dgc per-bucket"]
        rows = [measure(name, args, device, shapes, weights) for name in names]
    finally:
        from aiak import comm

        comm.shutdown()  # the hooks' groups, then the default one
        if dist.is_initialized():
            dist.destroy_process_group()
    by = {r["mode"]: r for r in rows}
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    numel = sum(math.prod(s) for s in shapes)
    print(f"DGC hook, {len(shapes)} tensors ({numel / 1e6:.1f} M), ratio {args.ratio}, {dev}")
    cols = ("mode", "host_ms", "step_ms", "aten_ops", "cuda_launches", "gpu_ms")
    print("  ".join(f"{c:>15}" for c in cols))
    for r in rows:
        cells = [r["mode"]] + [
            "" if r[c] is None else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
            for c in cols[1:]
        ]
        print("  ".join(f"{c:>15}" for c in cells))
    ar, pt, pb = (by[n]["host_ms"] for n in names)
    print(f"host ms per step, per-tensor / per-bucket: {pt / pb:.2f}x")
    print(f"host ms per step, per-bucket / allreduce: {pb / ar:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows))
    if args.csv:
        from _harness import append_csv

        append_csv("dgc_hook", [{**r, "world": 1, "ratio": args.ratio} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
