"""aiak::dgc_select vs torch.topk (same k, same run) and vs one read pass at copy bandwidth.

    python benchmarks/bench_dgc_select.py [--n 25000000] [--ratio 0.001]
    python benchmarks/bench_dgc_select.py --overlap   # overlap_step on a 1-GPU DDP ResNet-50
    python benchmarks/bench_dgc_select.py --segments  # one bucket of ResNet-50's 161 shapes

Targets (H100): selection >= 10x faster than torch.topk(|g|, k) and within 3x of the time one
read of the gradient takes at copy bandwidth (copy_bandwidth() counts read + write bytes, so
one read pass of B bytes takes B / bandwidth). Columns: ``*_ms`` are lone calls between CUDA
events (host launch time included), ``gpu_ms``/``topk_gpu_ms`` the same calls replayed from a
CUDA graph (GPU time alone), ``launches`` the kernels of one call (torch.profiler),
``launches_planned`` what the op issues; ``sum_gpu_ms`` the GPU time of ``torch.sum(g)``, one
read of the gradient by torch's own reduction (what a read pass takes in practice);
``plain_ms``/``gpu_plain_ms`` the same two with every launch plain (no programmatic dependent
launch), and the GPU time of each kernel in that mode.
``--overlap``: a ResNet-50 step (torchvision, ``--batch`` 32, NCCL world 1), DDP + SGD step after
backward, against the same step with aiak.comm.overlap_step (steps on aiak's worker thread, the
default, and inline on DDP's autograd thread); the share of the optimizer's own time (measured
alone) that disappears from the step is printed (target >= 70%).
``--segments``: ResNet-50's 161 parameter shapes as one bucket (one flat fp32 tensor, ``--ratio``,
sample ratio 0.01), the per-tensor ``dgc_select`` loop against one ``dgc_segments_select`` call:
``*_host_ms`` the host's time per call (return of the call, GPU not waited for), ``*_gpu_ms`` the
GPU time alone (CUDA graph replay), ``*_ms`` a call between CUDA events; the ratios are
loop / segments; appends to benchmarks/results/dgc_segments.csv.
The default mode appends to benchmarks/results/dgc_select.csv.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from _harness import append_csv, copy_bandwidth, print_table, time_eager, time_graph

import aiak.ops  # noqa: F401
from aiak.conformance.shapes import RESNET50
from aiak.ops import _driver
from aiak.ops.dgc_segments import dgc_segments_plan, dgc_segments_select
from aiak.ops.dgc_segments import launches_per_call as segment_launches
from aiak.ops.dgc_select import dgc_select, launches_per_call


def kernel_events(fn, calls: int = 1) -> list | None:
    """The GPU kernels ``calls`` calls of ``fn`` run, as torch.profiler events (None if it
    cannot profile)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        return [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    except Exception:
        return None


def kernel_launches(fn) -> int | None:
    """GPU kernels one call of ``fn`` runs, counted by torch.profiler (None if it cannot)."""
    events = kernel_events(fn)
    return None if events is None else len(events)


def kernel_times(fn, calls: int = 20) -> dict[str, float] | None:
    """Mean GPU time per kernel name over ``calls`` calls of ``fn`` (torch.profiler), in us."""
    events = kernel_events(fn, calls)
    if events is None:
        return None
    times: dict[str, float] = {}
    for e in events:
        name = e.name.split("(")[0]
        times[name] = times.get(name, 0.0) + e.device_time / calls
    return {k: round(v, 1) for k, v in times.items()}


def bench_select(n: int, ratio: float) -> dict:
    g = torch.randn(n, device="cuda")
    k = max(1, math.ceil(n * ratio))
    m = max(1, math.ceil(n * 0.01))
    stride = n // m

    def ours_fn():
        return dgc_select(g, k, m, 0, stride)

    def topk_fn():
        return torch.topk(g.abs(), k, sorted=False)

    _, ours, _ = time_eager(ours_fn)
    _, topk, _ = time_eager(topk_fn)
    graph = time_graph(ours_fn)  # GPU time alone (no host launch cost)
    graph_topk = time_graph(topk_fn)
    graph_sum = time_graph(lambda: torch.sum(g))  # one read of g by torch's own reduction
    # the same with every launch plain: what programmatic dependent launches save
    previous = _driver.programmatic_launches(False)
    try:
        _, plain, _ = time_eager(ours_fn)
        graph_plain = time_graph(ours_fn)
        per_kernel = kernel_times(ours_fn)
    finally:
        _driver.programmatic_launches(previous)
    bw = copy_bandwidth()  # GB/s of read + write
    read_ms = n * 4 / (bw * 1e9) * 1e3  # one read of the gradient at copy bandwidth
    gpu = graph[1] if graph else float("nan")
    gpu_topk = graph_topk[1] if graph_topk else float("nan")
    gpu_plain = graph_plain[1] if graph_plain else float("nan")
    gpu_sum = graph_sum[1] if graph_sum else float("nan")
    print("GPU time per kernel, plain launches (us):", per_kernel)
    return {
        "n": n,
        "k": k,
        "dgc_select_ms": round(ours, 4),
        "topk_ms": round(topk, 4),
        "speedup_vs_topk": round(topk / ours, 2),
        "gpu_ms": round(gpu, 4),
        "topk_gpu_ms": round(gpu_topk, 4),
        "gpu_speedup": round(gpu_topk / gpu, 2),
        "read_pass_ms": round(read_ms, 4),
        "x_read_pass": round(ours / read_ms, 2),
        "gpu_x_read_pass": round(gpu / read_ms, 2),
        "sum_gpu_ms": round(gpu_sum, 4),
        "plain_ms": round(plain, 4),
        "gpu_plain_ms": round(gpu_plain, 4),
        "launches": kernel_launches(ours_fn),  # counted; None when the profiler cannot
        "launches_planned": launches_per_call(True, 10),
    }


def host_ms(fn, calls: int = 50) -> float:
    """Host milliseconds per call of ``fn`` (its return; the GPU is not waited for)."""
    import time

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def bench_segments(ratio: float) -> dict:
    lengths = [math.prod(shape) for shape in RESNET50]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    x = torch.randn(sum(lengths), device="cuda")
    plan = dgc_segments_plan(lengths, starts, ratio, 0.01)
    table = plan.cuda()
    s0 = torch.tensor([r[6] // 2 for r in plan.tolist()], device="cuda")
    per_tensor = [  # (view, k, m, sample_start, stride) with the same plan
        (x[r[0] : r[0] + r[1]], r[2], r[4], r[6] // 2, r[6]) for r in plan.tolist()
    ]

    def segments_fn():
        return dgc_segments_select(x, table, s0)

    def loop_fn():
        return [dgc_select(v, k, m, a, st) for v, k, m, a, st in per_tensor]

    seg_host, loop_host = host_ms(segments_fn), host_ms(loop_fn, 10)
    _, seg_eager, _ = time_eager(segments_fn)
    _, loop_eager, _ = time_eager(loop_fn, reps=10)
    seg_graph, loop_graph = time_graph(segments_fn), time_graph(loop_fn)
    seg_gpu = seg_graph[1] if seg_graph else float("nan")
    loop_gpu = loop_graph[1] if loop_graph else float("nan")
    print("GPU time per kernel of one segments call (us):", kernel_times(segments_fn))
    return {
        "tensors": len(lengths),
        "elements": sum(lengths),
        "ratio": ratio,
        "loop_host_ms": round(loop_host, 3),
        "segments_host_ms": round(seg_host, 3),
        "host_ratio": round(loop_host / seg_host, 2),
        "loop_gpu_ms": round(loop_gpu, 3),
        "segments_gpu_ms": round(seg_gpu, 3),
        "gpu_ratio": round(loop_gpu / seg_gpu, 2),
        "loop_ms": round(loop_eager, 3),
        "segments_ms": round(seg_eager, 3),
        "ratio_loop_over_segments": round(loop_eager / seg_eager, 2),
        "launches": kernel_launches(segments_fn),
        "launches_planned": segment_launches(10, True),
        "loop_launches": kernel_launches(loop_fn),
    }


def bench_overlap(batch: int = 32, steps: int = 10, rounds: int = 5) -> dict:
    import statistics
    import time

    import torch.distributed as dist
    import torchvision

    from aiak import comm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def build(overlap: bool, offload: bool = True):
        torch.manual_seed(0)
        model = torchvision.models.resnet50().cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
        if overlap:
            comm.overlap_step(ddp, opt, hook=comm.allreduce(), offload=offload)
        else:
            comm.register(ddp, comm.allreduce())
        return model, ddp, opt

    def timed(fn, n: int = steps) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    def loop(ddp, opt, step: bool):
        def run() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if step:
                opt.step()

        return run

    _, ddp, opt = build(False)
    _, ddp_off, opt_off = build(True)
    _, ddp_in, opt_in = build(True, offload=False)
    variants = {
        "step": loop(ddp, opt, True),
        "no_step": loop(ddp, opt, False),
        "optimizer": opt.step,
        "overlap": loop(ddp_off, opt_off, False),
        "overlap_inline": loop(ddp_in, opt_in, False),
    }
    for fn in variants.values():
        timed(fn, 5)  # warm-up: cuDNN plans, the worker thread, the side stream
    # Rounds interleave the variants so that drifts of a noisy host hit them alike; medians.
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn))
    comm.shutdown()
    t = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "batch": batch,
        "step_ms": round(t["step"], 3),
        "no_step_ms": round(t["no_step"], 3),
        "optimizer_ms": round(t["optimizer"], 3),
        "overlap_ms": round(t["overlap"], 3),
        "optimizer_hidden": round((t["step"] - t["overlap"]) / t["optimizer"], 3),
        "overlap_inline_ms": round(t["overlap_inline"], 3),
        "inline_hidden": round((t["step"] - t["overlap_inline"]) / t["optimizer"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=25_000_000)
    p.add_argument("--ratio", type=float, default=0.001)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--segments", action="store_true", help="ResNet-50's shapes as one bucket")
    p.add_argument("--batch", type=int, default=32, help="--overlap: ResNet-50 batch")
    args = p.parse_args()
    if args.overlap:
        row = bench_overlap(args.batch)
        print_table([row], list(row))
        append_csv("dgc_overlap", [row])
        return
    if args.segments:
        row = bench_segments(args.ratio)
        print_table([row], list(row))
        append_csv("dgc_segments", [row])
        return
    row = bench_select(args.n, args.ratio)
    print_table([row], list(row))
    append_csv("dgc_select", [row])


if __name__ == "__main__":
    main()
