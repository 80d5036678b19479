"""Why the BERT-sized recipe's aiak + compile step can trail O1 + compile: LAMB or O2?

    python research/profile_bert_compiled.py [--batch 256] [--steps 10] [--rounds 3]

Three compiled set-ups of ``examples/recipes/bert_lamb.py``'s encoder, same weights and data:
``o1`` (autocast, torch fused AdamW: the recipe's baseline), ``o2_adamw`` (``aiak.amp.decorate``
+ ``aiak.optim.FusedAdamW``: O2 with the baseline's optimizer), ``o2_lamb`` (the recipe's aiak
set-up: O2 + LAMB). Per set-up: the median step of interleaved rounds, then one profiled step's
GPU time split into the optimizer's kernels and the rest. Needs a GPU; prints only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))
import bert_lamb  # noqa: E402

OPT_KERNELS = ("adam", "lamb", "multi_tensor", "l2norm", "foreach", "cast_scale")


def build(name: str, batch: int):
    dev = torch.device("cuda")
    run = bert_lamb.build(aiak=name != "o1", tiny=False, device=dev, batch=batch)
    if name == "o2_adamw":  # same model and amp, the baseline's optimizer
        import aiak.amp
        from aiak.optim import FusedAdamW

        base = bert_lamb.build(aiak=False, tiny=False, device=dev, batch=batch)
        opt = FusedAdamW(base.model.parameters(), lr=2e-4, weight_decay=0.01)
        aiak.amp.decorate(base.model, opt)
        base.optimizer, base.scaler = opt, aiak.amp.GradScaler("cuda")
        run = base
    return run.compile()


def timed(run, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    runs = {n: build(n, args.batch) for n in ("o1", "o2_adamw", "o2_lamb")}
    for run in runs.values():
        timed(run, 6)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(args.rounds):
        for n, run in runs.items():
            times[n].append(timed(run, args.steps))
    for n, run in runs.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run.step()
            torch.cuda.synchronize()
        total = opt = 0.0
        for e in prof.events():  # kernels only: an aten op's device time repeats its kernels'
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
            total += us
            if any(k in e.key.lower() for k in OPT_KERNELS):
                opt += us
        print(
            f"{n:9s} step {statistics.median(times[n]):7.2f} ms  GPU {total / 1e3:7.2f} ms, "
            f"optimizer-like kernels {opt / 1e3:5.2f} ms, rest {(total - opt) / 1e3:7.2f} ms"
        )


if __name__ == "__main__":
    main()
