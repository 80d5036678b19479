"""Where one training step's time goes on the GPU, from a chrome trace of
``bench_comm_nodes.py --trace DIR`` (rank 0, two profiled steps; the last one is read).

    python research/comm_trace_summary.py DIR/dgc-0.001_resnet50_rank0.json.gz [...]

Per trace: the step's wall time (its ``step`` range on the host), when the host finished the
forward, the backward call and the optimizer step, and per GPU stream its kernels' busy time,
first start and last end; then every NCCL kernel of the step (start, end, ms) and the compute
stream's idle gaps over 0.2 ms (where it waits for a collective or for the host). Times are ms
from the step's start.
"""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summary(events: list[dict]) -> list[str]:
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"] == "step"),
        key=lambda e: e["ts"],
    )
    if not steps:
        return ["no 'step' range in this trace"]
    st = steps[-1]
    t0, t1 = st["ts"], st["ts"] + st["dur"]

    def rel(t: float) -> float:
        return (t - t0) / 1e3

    inside = [e for e in events if t0 <= e["ts"] <= t1]
    out = [f"step {st['dur'] / 1e3:.2f} ms (host range)"]
    host = [e for e in inside if e.get("cat") == "cpu_op"]
    for label, key in (
        ("forward", "DistributedDataParallel.forward"),
        ("backward (last autograd node)", "autograd::engine::evaluate_function"),
        ("optimizer", "Optimizer.step"),
    ):
        hits = [e for e in inside if e["name"].startswith(key)]
        if hits:
            end = max(e["ts"] + e["dur"] for e in hits)
            out.append(f"host: {label} done at {rel(end):.2f} ms")
    out.append(f"host: {len(host)} cpu ops")
    gpu = sorted((e for e in inside if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    streams: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream", -1)].append(e)
    compute = max(streams, key=lambda s: len(streams[s])) if streams else None
    for s, es in sorted(streams.items()):
        busy = sum(e["dur"] for e in es) / 1e3
        first, last = rel(es[0]["ts"]), rel(max(e["ts"] + e["dur"] for e in es))
        tag = " (compute)" if s == compute else ""
        out.append(
            f"stream {s}{tag}: {len(es)} kernels, busy {busy:.2f} ms, {first:.2f} .. {last:.2f}"
        )
    for e in gpu:
        if "nccl" in e["name"].lower():
            a, b = rel(e["ts"]), rel(e["ts"] + e["dur"])
            out.append(f"  nccl {e['name'][:48]:48s} {a:8.2f} .. {b:8.2f}  {b - a:6.2f} ms")
    if compute is not None:
        es = streams[compute]
        gaps = []
        for prev, nxt in itertools.pairwise(es):
            g = nxt["ts"] - (prev["ts"] + prev["dur"])
            if g > 200:
                gaps.append((rel(prev["ts"] + prev["dur"]), g / 1e3, nxt["name"][:60]))
        idle = sum(g for _, g, _ in gaps)
        out.append(f"compute stream gaps > 0.2 ms: {len(gaps)}, {idle:.2f} ms in all")
        for at, g, name in gaps:
            out.append(f"  at {at:8.2f}: {g:6.2f} ms idle, then {name}")
    return out


def main() -> None:
    for arg in sys.argv[1:]:
        print(f"=== {arg}")
        print("\n".join(summary(load(Path(arg)))))


if __name__ == "__main__":
    main()
