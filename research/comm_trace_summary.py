"""Where one training step's time goes on the GPU, from a chrome trace of
``bench_comm_nodes.py --trace DIR`` (rank 0, two profiled steps; the last one is read).

    python research/comm_trace_summary.py DIR/dgc-0.001_resnet50_rank0.json.gz [...]

Per trace: the step's wall time (its ``step`` range on the host), when the host finished the
forward, the backward call and the optimizer step, and per GPU stream its kernels' busy time,
first start and last end; then every NCCL kernel of the step (start, end, ms) and the compute
stream's idle gaps over 0.2 ms (where it waits for a collective or for the host). Times are ms
from the step's start.

The optimizer's tail: the kernels launched inside ``Optimizer.step`` ranges (matched to their
launch by the trace's correlation ids), their GPU time, and the ``tail``: from the end of the
step's last collective (the exchange's end) to the end of its last optimizer kernel, i.e. the
optimizer's host work and kernels left on the step's critical path. A plain step has its whole
optimizer there; the backward/step overlap leaves only the last bucket's update. With
``--overlap BASE OVER`` (traces of the same model without and with
``--overlap-backward-and-step``) it prints the share of the base step's tail that the overlap
removes: the share of the optimizer's time that leaves the step. It is read inside one step of
each trace, so the run-to-run spread of the step between jobs (tens of ms on the 2 x 2 machine,
against an optimizer of 0.4-3 ms) does not enter it.

    python research/comm_trace_summary.py --overlap DIR/fused-sgd_resnet50_rank0.json.gz \
        DIR/overlap_resnet50_rank0.json.gz
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


def last_step(events: list[dict]) -> dict | None:
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"] == "step"),
        key=lambda e: e["ts"],
    )
    return steps[-1] if steps else None


def optimizer_tail(events: list[dict], st: dict) -> dict:
    """The step's optimizer kernels (launched inside an ``Optimizer.step`` range of the same
    host thread), their GPU ms, the host ms of those ranges, and the tail: ms from the end of
    the step's last collective (without one, its last other kernel) to the end of its last
    optimizer kernel."""
    t0, t1 = st["ts"], st["ts"] + st["dur"]
    ranges = [
        (e["ts"], e["ts"] + e["dur"], e.get("tid"))
        for e in events
        if e["name"].startswith("Optimizer.step#") and t0 <= e["ts"] <= t1
    ]
    launches = {
        e["args"]["correlation"]: (e["ts"], e.get("tid"))
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }

    def in_optimizer(k: dict) -> bool:
        at = launches.get(k.get("args", {}).get("correlation"))
        return at is not None and any(a <= at[0] <= b and tid == at[1] for a, b, tid in ranges)

    # kernels launched inside the step (a late kernel of the step may end after its host range)
    gpu = [
        e
        for e in events
        if e.get("cat") in GPU_CATS
        and t0 <= launches.get(e.get("args", {}).get("correlation"), (e["ts"], None))[0] <= t1
    ]
    opt, other = [], []
    for k in gpu:
        (opt if in_optimizer(k) else other).append(k)
    # the exchange's end: the step's last collective (without one, its last other kernel)
    rest = [k for k in other if "nccl" in k["name"].lower()] or other
    rest_end = max((k["ts"] + k["dur"] for k in rest), default=t0)
    opt_end = max((k["ts"] + k["dur"] for k in opt), default=rest_end)
    return {
        "kernels": len(opt),
        "gpu_ms": sum(k["dur"] for k in opt) / 1e3,
        "host_ms": sum(b - a for a, b, _ in outermost(ranges)) / 1e3,
        "tail_ms": max(0.0, opt_end - rest_end) / 1e3,
    }


def outermost(ranges: list[tuple]) -> list[tuple]:
    """The ranges not inside another one."""
    out: list[tuple] = []
    for a, b, tid in sorted(ranges, key=lambda r: (r[0], -r[1])):
        if out and a >= out[-1][0] and b <= out[-1][1]:
            continue
        out.append((a, b, tid))
    return out


def summary(events: list[dict]) -> list[str]:
    st = last_step(events)
    if st is None:
        return ["no 'step' range in this trace"]
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
    t = optimizer_tail(events, st)
    out.append(
        f"optimizer: {t['kernels']} kernels, {t['gpu_ms']:.2f} ms GPU, {t['host_ms']:.2f} ms host "
        f"in Optimizer.step; tail after the last collective {t['tail_ms']:.2f} ms"
    )
    return out


def overlap_share(base: Path, over: Path) -> str:
    """The share of the base step's optimizer tail that the overlapped step does not have."""
    tails = []
    for path in (base, over):
        events = load(path)
        st = last_step(events)
        if st is None:
            return f"no 'step' range in {path}"
        tails.append(optimizer_tail(events, st)["tail_ms"])
    if tails[0] <= 0:
        return f"the base trace has no optimizer tail ({base})"
    share = 1.0 - tails[1] / tails[0]
    return (
        f"optimizer tail: {tails[0]:.2f} ms without the overlap, {tails[1]:.2f} ms with it: "
        f"{100 * share:.0f}% of the optimizer's time leaves the step"
    )


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--overlap"]:
        if len(args) != 3:
            sys.exit("usage: comm_trace_summary.py --overlap BASE_TRACE OVERLAP_TRACE")
        print(overlap_share(Path(args[1]), Path(args[2])))
        return
    for arg in args:
        print(f"=== {arg}")
        print("\n".join(summary(load(Path(arg)))))


if __name__ == "__main__":
    main()
