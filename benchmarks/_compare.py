"""One comparison table for the per-op benchmarks (bench_fused_*.py, bench_multi_tensor_*.py):
per candidate, back-to-back time, GPU time and their ratio, % of copy bandwidth.

- ``ms``: calls back to back between two events (max of host and GPU per call, as in
  training): the figure.
- ``gpu_ms``: the GPU's own time per call, from the profiler (sum of the kernels' device
  time), so it is there for every candidate, CUDA-graph capturable or not.
- ``ratio`` = ms / gpu_ms: 1.0 is GPU-bound; above, the host makes the GPU wait.
- ``%copy``: the op's floor bytes over gpu_ms, against the device-to-device copy bandwidth.

apex (``amp_C``, ``apex.optimizers``) rows appear when apex is importable; otherwise one line
says they are skipped and why.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from _harness import append_csv, copy_bandwidth, print_table, time_pipelined

from aiak.conformance.shapes import BERT_LARGE, RESNET50
from aiak.ops import _host

SETS = {"resnet": RESNET50, "bert": BERT_LARGE}


def apex_module(name: str) -> tuple[Any, str | None]:
    """(module, None) when ``name`` (``amp_C``, ``apex.optimizers``) imports, else
    (None, why)."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # not installed, or built for another torch
        return None, f"{type(exc).__name__}: {exc}"


def optimizer_step(make: Callable[[list[torch.Tensor]], Any], shapes) -> Callable[[], Any]:
    """The ``step`` of ``make(params)`` over fresh CUDA params of ``shapes`` with grads, stepped
    once already (state, tables, compilation)."""
    params = [torch.randn(s, device="cuda").requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    opt.step()
    return opt.step


def gpu_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """GPU time per call of ``fn``: the device time of every kernel it launched (profiler)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    return total / calls / 1e3


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    p20, p50, p80 = time_pipelined(fn, calls=20, reps=10)
    g = gpu_ms(fn)
    return {"ms": p50, "p20": p20, "p80": p80, "gpu_ms": g, "ratio": p50 / g if g else math.nan}


def run(
    bench: str,
    cases: Callable[[str, list[tuple[int, ...]]], Iterable[tuple[str, int, str, Callable]]],
    sets: str,
    skip_notes: Iterable[str] = (),
) -> int:
    """``cases(set_name, shapes)`` yields (op, floor bytes, candidate label, fn); the first
    candidate of each op is aiak's. Prints one table, appends the rows to results/<bench>.csv."""
    if not torch.cuda.is_available():
        print(f"{bench}: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (r+w)")
    for note in skip_notes:
        print(note)
    rows = []
    for set_name in sets.split(","):
        shapes = SETS[set_name]
        ours: dict[str, float] = {}
        for op, nbytes, label, fn in cases(set_name, shapes):
            # aiak's rows again on the Python host path (ops/_host.py), in the same run: what
            # the compiled per-tensor reads save
            twin = label.startswith("aiak") and _host.native() is not None
            for suffix, native in [("", True), (" (python host)", False)][: 2 if twin else 1]:
                if twin:
                    _host.use_native(native)
                r = measure(fn)
                ours.setdefault(op, r["ms"])
                rows.append(
                    {
                        "set": f"{set_name}[{len(shapes)}]",
                        "op": op,
                        "impl": label + suffix,
                        **r,
                        "pct_copy": 100 * nbytes / (r["gpu_ms"] * 1e-3) / 1e9 / copy_gbs,
                        "vs_aiak": r["ms"] / ours[op],
                    }
                )
            if twin:
                _host.use_native(True)
            torch.cuda.empty_cache()
    cols = ["set", "op", "impl", "ms", "gpu_ms", "ratio", "pct_copy", "vs_aiak", "p20", "p80"]
    print("ms = back to back; gpu_ms = kernels' device time; ratio = ms / gpu_ms")
    print_table(rows, cols)
    print(f"rows appended to {append_csv(bench, rows)}")
    return 0


def cli(
    bench: str,
    cases: Callable[[str, list[tuple[int, ...]]], Iterable[tuple[str, int, str, Callable]]],
    apex: str,
    doc: str,
    argv: list[str] | None = None,
) -> int:
    """A per-op benchmark's command line (``--sets``, the description from ``doc``'s first
    line) and :func:`run`, with one line saying why the apex rows are skipped when the module
    ``apex`` (``amp_C``, ``apex.optimizers``) does not import."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sets", default="resnet,bert")
    args = ap.parse_args(argv)
    _, why = apex_module(apex)
    return run(bench, cases, args.sets, [f"apex rows skipped: {why}"] if why else [])
