"""Lower bounds for the stages of aiak::dgc_select, next to its own kernels, in one process.

    python research/profile_dgc_floor.py [--n 25000000] [--ratio 0.001]

Each kernel of research/kernels/dgc_floor.cu does one stage's unavoidable work and nothing
else, on the same gradient and geometry (25M fp32, 1% strided samples, 4 thresholds): one read,
the read with the four counts, the counts written per warp and tile, the same with the tile's
candidates in index order, the sample gather with and without its histogram (also after a read
of x has evicted the sampled sectors from L2, and right after a selection, as the op's sample
kernel meets them), an empty launch. Columns:
``kernel_us`` the GPU time of the kernel alone (torch.profiler), ``graph_us`` one call replayed
from a CUDA graph (the launch gap included). aiak's own kernels follow (plain launches, as
bench_dgc_select.py's per-kernel figures), then the op's graph time next to the same op with
its gated launches (which return at once on this gradient) not issued. What a stage cannot go
below bounds what a redesign of it could gain.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth, print_table, time_graph
from bench_dgc_select import kernel_times

from aiak.ops import _dgc_select_cuda, _driver
from aiak.ops.dgc_select import dgc_select

_SOURCE = Path(__file__).resolve().parent / "kernels" / "dgc_floor.cu"
_TILE, _BLOCK = 8192, 256


def _module():
    import cupy

    return cupy, cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++17",))


# the launches that return at once unless the adaptation loop needs them (the full count, the
# exact top-k): with this gradient every gate stays shut
_GATED = ("dgc_count_reg", "dgc_count_search", "dgc_exact_hist", "dgc_exact_counts")


@contextlib.contextmanager
def _gated_launches_off():
    """Inside, the op does not issue its gated launches: what gating them on the device, without
    a launch from the host, could save. Its workspaces are set aside meanwhile, so that the one
    made inside has the no-op launches and none of them outlives the block."""
    kernel, saved = _dgc_select_cuda._kernel, dict(_dgc_select_cuda._workspaces)
    _dgc_select_cuda._kernel = lambda name: (lambda *a: None) if name in _GATED else kernel(name)
    _dgc_select_cuda._workspaces.clear()
    try:
        yield
    finally:
        _dgc_select_cuda._kernel = kernel
        _dgc_select_cuda._workspaces.clear()
        _dgc_select_cuda._workspaces.update(saved)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=25_000_000)
    p.add_argument("--ratio", type=float, default=0.001)
    args = p.parse_args()
    n = -(-args.n // _TILE) * _TILE  # whole tiles: the floor kernels do not check bounds
    tiles = n // _TILE
    g = torch.randn(n, device="cuda")
    k = max(1, math.ceil(n * args.ratio))
    m = max(1, math.ceil(n * 0.01))
    stride = n // m
    # the loop's first four thresholds, thr0 from the samples as the op computes it
    samples = g[::stride][:m].abs()
    ks = max(1, (m * k + n - 1) // n)
    thr0 = samples.topk(ks).values[-1].item()
    thr = torch.tensor([thr0 * 0.8**j for j in range(4)], device="cuda").view(torch.int32)
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    hist = torch.zeros(2048, dtype=torch.int32, device="cuda")
    compact = torch.empty(m, dtype=torch.int32, device="cuda")
    tile_cnt = torch.empty(2 * tiles * 8, dtype=torch.int32, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    cupy, mod = _module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launcher(name: str, grid: int, kargs: tuple):
        fn = mod.get_function(name)
        # tensors as their addresses, integers as the kernels' i64 parameters
        cargs = tuple(
            cupy.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else cupy.int64(a)
            for a in kargs
        )

        def run() -> None:
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn((grid,), (_BLOCK,), cargs)

        return run

    tile_args = (g, tiles, thr, out, tile_cnt)
    gather_grid = max(1, min(-(-m // (4 * _BLOCK)), 4 * sms))
    floors = {
        "floor_read": launcher("floor_read", min(tiles, 4 * sms), tile_args),
        "floor_count": launcher("floor_count", min(tiles, 4 * sms), tile_args),
        "floor_count_warp": launcher("floor_count_warp", min(tiles, 4 * sms), tile_args),
        "floor_gather": launcher("floor_gather", gather_grid, (g, m, stride, compact, hist, out)),
        "floor_sample": launcher("floor_sample", gather_grid, (g, m, stride, compact, hist, out)),
        "floor_empty": launcher("floor_empty", 4 * sms, (flag,)),
    }
    cap = 64
    cval = torch.empty(tiles * cap, device="cuda")
    cidx = torch.empty(tiles * cap, dtype=torch.int16, device="cuda")
    floors["floor_count_cand"] = launcher(
        "floor_count_cand", min(tiles, 4 * sms), (g, tiles, thr, tile_cnt, cval, cidx, cap)
    )
    # the gathers after a read of x has evicted the sampled sectors from L2, and after a whole
    # selection (what the sample kernel meets when the op is called step after step)
    flush = floors["floor_read"]
    for name in ("floor_gather", "floor_sample"):
        floors[name + " (cold)"] = lambda f=floors[name]: (flush(), f())
        floors[name + " (cold, after a selection)"] = lambda f=floors[name]: (
            dgc_select(g, k, m, 0, stride),
            f(),
        )
    rows = []
    for name, fn in floors.items():
        per = kernel_times(fn) or {}
        row = {"kernel": name, "kernel_us": per.get(name.split(" ")[0], float("nan"))}
        if "cold" not in name:  # a cold call's graph would time the flush with it
            graph = time_graph(fn)
            row["graph_us"] = round(graph[1] * 1e3, 1) if graph else float("nan")
        rows.append(row)
    bw = copy_bandwidth()
    rows.append({"kernel": "read at copy bandwidth", "kernel_us": round(n * 4 / bw / 1e3, 1)})
    graph = time_graph(lambda: torch.sum(g))
    rows.append({"kernel": "torch.sum", "graph_us": round(graph[1] * 1e3, 1) if graph else None})

    def ours():
        return dgc_select(g, k, m, 0, stride)

    want = ours()
    with _gated_launches_off():
        got = ours()
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "a gate opened on this gradient"

    previous = _driver.programmatic_launches(False)
    try:
        per = kernel_times(ours) or {}
        plain = time_graph(ours)
    finally:
        _driver.programmatic_launches(previous)
    for name, us in per.items():
        rows.append({"kernel": f"aiak {name}", "kernel_us": us})
    rows.append({"kernel": "aiak dgc_select, plain launches", "graph_us": round(plain[1] * 1e3, 1)})
    # interleaved, twice: the graph times of separate processes differ by 3-5 us
    for off in (False, True) * 2:
        with _gated_launches_off() if off else contextlib.nullcontext():
            graph = time_graph(ours)
        name = "aiak dgc_select, programmatic" + (", gated launches not issued" if off else "")
        rows.append({"kernel": name, "graph_us": round(graph[1] * 1e3, 1) if graph else None})
    graph = time_graph(lambda: torch.topk(g.abs(), k, sorted=False))
    rows.append({"kernel": "torch.topk(|g|)", "graph_us": round(graph[1] * 1e3, 1)})
    print(f"{torch.cuda.get_device_name()}, n = {n}, k = {k}, {m} samples (stride {stride})")
    print_table(rows, ["kernel", "kernel_us", "graph_us"])


if __name__ == "__main__":
    main()
