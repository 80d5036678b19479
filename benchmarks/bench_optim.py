"""aiak.optim vs torch.optim: one optimizer step on BERT-large-like and ResNet-50-like sets.

    python benchmarks/bench_optim.py [--sets bert,resnet] [--opts adamw,sgd,lamb]

Sets (aiak.conformance.shapes): BERT-large (334M fp32 params in 389 tensors), ResNet-50
(25.6M in 161). Rows: ours vs torch for-loop / foreach / fused (AdamW, SGD momentum), and LAMB
vs the same LAMB written with torch._foreach ops (aiak.optim's fallback path). Bytes per fp32
param counted as each step's floor:

    AdamW 28 B  read p, g, exp_avg, exp_avg_sq (16) + write p, exp_avg, exp_avg_sq (12)
    SGD   20 B  read p, g, momentum_buffer (12) + write p, momentum_buffer (8)
    LAMB  44 B  grad norm: read g (4); stage 1: read p, g, m, v (16) + write m, v, u (12);
                stage 2: read p, u (8) + write p (4)

"ms" is the pipelined time per step (steps back to back: max(host, GPU), as in training);
"graph_ms" the GPU time alone (replayed from a CUDA graph; "-" where torch cannot be captured);
"%copy" = bytes / graph time over the device-to-device copy bandwidth measured in this run;
"peak_MB" the memory a step allocates beyond the params, grads and state it starts with.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from _harness import append_csv, copy_bandwidth, print_table, time_graph, time_pipelined

import aiak.optim._common as C
from aiak.conformance.shapes import BERT_LARGE, RESNET50
from aiak.optim import LAMB, FusedAdamW, FusedSGD

SETS = {"bert": BERT_LARGE, "resnet": RESNET50}
BYTES = {"adamw": 28, "sgd": 20, "lamb": 44}


def _candidates(opt: str):
    """(label, factory(params) -> optimizer, runs with the foreach fallback forced)."""
    if opt == "adamw":
        kw = {"lr": 1e-3, "weight_decay": 0.01}
        return [
            ("aiak FusedAdamW", lambda p: FusedAdamW(p, **kw), False),
            ("torch for-loop", lambda p: torch.optim.AdamW(p, foreach=False, **kw), False),
            ("torch foreach", lambda p: torch.optim.AdamW(p, foreach=True, **kw), False),
            ("torch fused", lambda p: torch.optim.AdamW(p, fused=True, **kw), False),
        ]
    if opt == "sgd":
        kw = {"lr": 0.1, "momentum": 0.9}
        return [
            ("aiak FusedSGD", lambda p: FusedSGD(p, **kw), False),
            ("torch for-loop", lambda p: torch.optim.SGD(p, foreach=False, **kw), False),
            ("torch foreach", lambda p: torch.optim.SGD(p, foreach=True, **kw), False),
            ("torch fused", lambda p: torch.optim.SGD(p, fused=True, **kw), False),
        ]
    kw = {"lr": 1e-3, "weight_decay": 0.01}
    return [
        ("aiak LAMB", lambda p: LAMB(p, **kw), False),
        ("foreach LAMB", lambda p: LAMB(p, **kw), True),
    ]


def _measure(shapes, make, force_foreach: bool) -> dict[str, float]:
    C.FORCE_FOREACH = force_foreach
    try:
        params = [torch.randn(s, device="cuda").requires_grad_() for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make(params)
        opt.step()  # state, tables, compilation
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        p20, p50, p80 = time_pipelined(opt.step, calls=10, reps=10)
        graph = time_graph(opt.step)
        out = {"ms": p50, "p20": p20, "p80": p80, "peak_MB": peak}
        out["graph_ms"] = graph[1] if graph else float("nan")
        del opt, params
        return out
    finally:
        C.FORCE_FOREACH = False
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="bert,resnet")
    ap.add_argument("--opts", default="adamw,sgd,lamb")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_optim: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (r+w)")
    rows = []
    for set_name in args.sets.split(","):
        shapes = SETS[set_name]
        n = sum(math.prod(s) for s in shapes)
        for opt in args.opts.split(","):
            nbytes = BYTES[opt] * n
            results = []
            for label, make, foreach in _candidates(opt):
                r = _measure(shapes, make, foreach)
                best = r["graph_ms"] if r["graph_ms"] == r["graph_ms"] else r["ms"]
                r["pct_copy"] = 100 * nbytes / (best * 1e-3) / 1e9 / copy_gbs
                results.append((label, r))
            ours_ms = results[0][1]["ms"]
            for label, r in results:
                rows.append(
                    {
                        "set": f"{set_name}[{len(shapes)}]",
                        "opt": opt,
                        "impl": label,
                        "params_M": n / 1e6,
                        "bytes_per_param": BYTES[opt],
                        **r,
                        "ours_speedup": r["ms"] / ours_ms,
                    }
                )
    cols = [
        "set",
        "opt",
        "impl",
        "ms",
        "p20",
        "p80",
        "graph_ms",
        "pct_copy",
        "peak_MB",
        "ours_speedup",
    ]
    print_table(rows, cols)
    path = append_csv("bench_optim", rows)
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
