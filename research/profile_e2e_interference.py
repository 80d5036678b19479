"""What slows a recipe's steps in a process that holds its other set-ups?

    python research/profile_e2e_interference.py [--recipe swin_t] [--rounds 5] [--steps 10]
                                                [--stages alone,compiled,graphed,freeze]

``bench_e2e.py`` holds every mode of a recipe in one process. Its eager rounds have come out
slower and more spread there than in a process holding one set-up, and the BERT recipe's
compiled aiak step slower with the graphed set-ups present. Stages, in the order given, each
timing set-ups in interleaved rounds of ``--steps`` steps (``bench_e2e``'s rounds):

- ``alone``: the aiak eager set-up alone (built first); with the O1 set-up built, the two
  interleaved; each alone with the other idle; aiak alone after O1 is deleted and the
  allocator's cache emptied;
- ``compiled``: O1 (again, if deleted) and both compiled set-ups added, all timed;
- ``graphed``: both graphed set-ups (``Run.graph``) added, all timed; then the graphed ones
  deleted (their memory pools freed), the rest timed again;
- ``freeze``: ``gc.freeze()`` (every object alive moved to the permanent generation, which the
  collector no longer walks), all timed.

Per set-up: the median step of the rounds (min-max), and the time and number of Python GC
passes per generation inside the timed steps (``gc.callbacks``). Needs a GPU; prints only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))

BATCH = {"swin_t": 64, "resnet50": 128, "bert_lamb": 256, "yolox_simota": 64}


class GcClock:
    """Time and count of the collector's passes per generation, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.t0 = 0.0
        self.ms: dict[int, float] = defaultdict(float)
        self.n: dict[int, int] = defaultdict(int)
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.ms[info["generation"]] += (time.perf_counter() - self.t0) * 1e3
            self.n[info["generation"]] += 1

    def take(self) -> str:
        out = " ".join(f"gen{g} {self.n[g]}x {self.ms[g]:.1f} ms" for g in sorted(self.n))
        self.ms.clear()
        self.n.clear()
        return out or "none"


def timed(run, steps: int, clock: GcClock) -> float:
    torch.cuda.synchronize()
    clock.on = True
    t0 = time.perf_counter()
    for _ in range(steps):
        run.step()
    torch.cuda.synchronize()
    clock.on = False
    return (time.perf_counter() - t0) * 1e3 / steps


def rounds(runs: dict, n: int, steps: int, clock: GcClock, label: str) -> None:
    times: dict[str, list[float]] = {m: [] for m in runs}
    gcs: dict[str, list[str]] = {m: [] for m in runs}
    modes = list(runs)
    for r in range(n):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            times[mode].append(timed(runs[mode], steps, clock))
            gcs[mode].append(clock.take())
    print(f"\n--- {label}")
    for mode in modes:
        t = times[mode]
        print(
            f"  {mode:<14} median {statistics.median(t):6.2f} ms  ({min(t):.2f}-{max(t):.2f})"
            f"   gc per round: {' | '.join(gcs[mode])}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="swin_t")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stages", default="alone", help="alone, compiled, graphed, freeze")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    recipe = __import__(args.recipe)
    dev = torch.device("cuda")
    clock = GcClock()

    def build(aiak: bool, compiled: bool, graphed: bool = False):
        run = recipe.build(aiak=aiak, tiny=False, device=dev, batch=BATCH[args.recipe])
        run = run.compile() if compiled else run.graph() if graphed else run
        for _ in range(10):
            run.step()
        return run

    print(f"{args.recipe}: gc thresholds {gc.get_threshold()}, objects {len(gc.get_objects())}")
    runs: dict = {}

    def drop(*modes: str) -> None:
        for mode in modes:
            del runs[mode]
        gc.collect()
        torch.cuda.empty_cache()

    for stage in args.stages.split(","):
        if stage == "alone":
            runs["aiak"] = build(True, False)
            rounds(runs, args.rounds, args.steps, clock, "aiak alone in the process")
            runs["o1"] = build(False, False)
            rounds(runs, args.rounds, args.steps, clock, "O1 built, the two interleaved")
            for mode in ("aiak", "o1"):
                rounds({mode: runs[mode]}, args.rounds, args.steps, clock, f"{mode} alone")
            drop("o1")
            rounds(runs, args.rounds, args.steps, clock, "aiak alone, O1 deleted")
        elif stage == "compiled":
            for mode, aiak in (("o1", False), ("aiak", True)):
                if mode not in runs:
                    runs[mode] = build(aiak, False)
            t0 = time.perf_counter()
            runs["o1_compile"] = build(False, True)
            runs["aiak_compile"] = build(True, True)
            print(f"\ncompiled both in {time.perf_counter() - t0:.0f} s")
            rounds(runs, args.rounds, args.steps, clock, "with the compiled set-ups")
        elif stage == "graphed":
            runs["o1_graphs"] = build(False, False, graphed=True)
            runs["aiak_graphs"] = build(True, False, graphed=True)
            rounds(runs, args.rounds, args.steps, clock, "with the graphed set-ups")
            drop("o1_graphs", "aiak_graphs")
            rounds(runs, args.rounds, args.steps, clock, "graphed set-ups deleted")
        elif stage == "freeze":
            gc.collect()
            gc.freeze()
            print(f"\ngc.freeze(): {gc.get_freeze_count()} objects frozen")
            rounds(runs, args.rounds, args.steps, clock, "after gc.freeze()")
        else:
            p.error(f"--stages: unknown stage {stage!r}")


if __name__ == "__main__":
    main()
