"""Benchmark harness: CUDA-event timing, copy bandwidth in the same run, CSV rows, a table.

Baseline and candidate run in one process on the same inputs; the ratio is the figure. Each
row is appended to ``benchmarks/results/<name>.csv`` with the GPU name, versions and the date.

Three timings per function:
- ``eager``: CUDA events around each lone call (p20/p50/p80 over many calls), the GPU idle
  before it: host time and GPU time add up. What a single isolated call costs.
- ``pipelined``: many calls back to back between two events: max(host, GPU) per call, as in a
  training loop where the host runs ahead of the GPU.
- ``graph``: the same call captured ``GRAPH_CALLS`` times in a CUDA graph and replayed: the
  GPU time alone, as inside a training step where host work overlaps earlier GPU work.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GRAPH_CALLS = 10


def quantiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(p20, p50, p80) of ``samples``."""
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return q[1], statistics.median(samples), q[7]


def time_eager(fn: Callable[[], Any], warmup: int = 5, reps: int = 50) -> tuple[float, ...]:
    """(p20, p50, p80) milliseconds of ``fn``, each call between its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return quantiles([s.elapsed_time(e) for s, e in pairs])


def time_pipelined(fn: Callable[[], Any], calls: int = 20, reps: int = 10) -> tuple[float, ...]:
    """(p20, p50, p80) milliseconds per call of ``fn`` called ``calls`` times back to back
    between two events: max(host, GPU) per call, as in a training loop."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return quantiles(samples)


def time_graph(fn: Callable[[], Any], reps: int = 20) -> tuple[float, ...] | None:
    """(p20, p50, p80) milliseconds per call of ``fn`` replayed from a CUDA graph, or None when
    ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception:
        return None
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_CALLS)
    return quantiles(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    _, p50, _ = time_eager(lambda: dst.copy_(src), warmup=3, reps=20)
    return 2 * nbytes / (p50 * 1e-3) / 1e9


def environment() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return ""

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cupy": version("cupy-cuda13x") or version("cupy-cuda12x") or version("cupy"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def append_csv(name: str, rows: Sequence[dict[str, Any]]) -> Path:
    """Append ``rows`` (plus the environment columns) to ``results/<name>.csv``."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.csv"
    env = environment()
    rows = [{**env, **r} for r in rows]
    fields = list(rows[0])
    old: list[dict[str, str]] = []
    rewrite = not path.exists()
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            known = list(reader.fieldnames or [])
            if set(fields) <= set(known):
                fields = known
            else:  # a benchmark gained columns: rewrite with the union (old rows leave them empty)
                old, rewrite = list(reader), True
                fields = known + [c for c in fields if c not in known]
    with path.open("w" if rewrite else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if rewrite:
            writer.writeheader()
            writer.writerows(old)
        writer.writerows(rows)
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """A plain fixed-width table (it must survive any log)."""

    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
