"""Where an eager recipe step's host time goes: O1 against aiak, phase by phase.

    python research/profile_eager_host.py [--recipes swin_t,resnet50] [--steps 20] [--top 25]
                                          [--setups o1,aiak] [--rounds 0]
                                          [--graphs | --graphs-detached]

The recipes' eager set-ups (``examples/recipes``), one GPU. A host-bound step takes its
Python's time, not its kernels' (the graphed modes of ``bench_e2e.py --graphs`` give the
kernels' time), so this splits the host's time per step:

- the step's phases, timed from the host without synchronising (the launch queue does not
  fill while the GPU is ahead): zero_grad + batch, forward + loss, backward, scaler.step +
  update;
- one profiled step: kernel launches, the aten ops by count and by self CPU time;
- cProfile over ``--steps`` steps: the Python functions by own time.

``--graphs``: the set-ups graphed first (``Run.graph``), the host's share of a graphed step.
``--graphs-detached``: the same, then the graphs' static outputs swapped for detached views
(through ``make_graphed_callables``' closures: an experiment, not for the product): their
autograd graph, and with it the parameters' ``AccumulateGrad`` nodes made on the capture
stream, dies, so the step's gradients meet nodes of the default stream (torch warns of the
stream mismatch otherwise, and syncs the two streams per parameter).

``--rounds R``: then R more rounds of ``--steps`` steps, the phases of each printed, and the
cProfile once more after them (does a set-up's host time drift over a run?).

Needs a GPU (and timm / torchvision for the recipes' models); prints only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))
from _recipe import half_dtype  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
PHASES = ("zero_grad+batch", "forward+loss", "backward", "step+update")


def phased_step(run, times: dict[str, list[float]] | None) -> None:
    """``Run.step`` with the host's time of each phase appended to ``times``."""
    t = [time.perf_counter()]
    run.optimizer.zero_grad(set_to_none=True)
    batch = run.next_batch()
    t.append(time.perf_counter())
    with torch.autocast(run.device.type, dtype=half_dtype(run.device)):
        loss = run.loss_fn(run.forward, batch)
    t.append(time.perf_counter())
    run.scaler.scale(loss).backward()
    t.append(time.perf_counter())
    run.scaler.step(run.optimizer)
    run.scaler.update()
    t.append(time.perf_counter())
    if times is not None:
        for name, a, b in zip(PHASES, t, t[1:]):
            times[name].append((b - a) * 1e3)


def timed_phases(run, steps: int) -> str:
    """``steps`` steps: their synchronised mean, and each phase's median host time."""
    times: dict[str, list[float]] = defaultdict(list)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        phased_step(run, times)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    split = ", ".join(f"{p} {statistics.median(times[p]):.2f}" for p in PHASES)
    return f"step {wall:.2f} ms (synchronised mean); host medians ms: {split}"


def python_profile(run, steps: int, top: int, title: str) -> None:
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(steps):
        phased_step(run, None)
    torch.cuda.synchronize()
    prof_py.disable()
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(top)
    print(title)
    keep = False
    for line in out.getvalue().splitlines():
        keep = keep or line.strip().startswith("ncalls")
        if keep and line.strip():
            print("   ", line[:160])


def detach_static_outputs(model: torch.nn.Module) -> None:
    """Swap the static outputs a graphed module's forward returns for detached views of the
    same memory (torch's ``make_graphed_callables`` keeps them with their capture-time autograd
    graph for the module's life)."""

    def cells(fn) -> dict:
        return dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    graphed = cells(model.forward)["graphed"].cell_contents
    autograd_fn = cells(graphed)["Graphed"].cell_contents
    cell = cells(autograd_fn.forward)["static_outputs"]
    cell.cell_contents = tuple(o.detach() for o in cell.cell_contents)


def profile_recipe(
    name: str, aiak: bool, steps: int, top: int, rounds: int, graphs: str = ""
) -> None:
    mod = __import__(name)
    dev = torch.device("cuda")
    batch = {"swin_t": 64, "resnet50": 128, "bert_lamb": 256, "yolox_simota": 64}[name]
    run = mod.build(aiak=aiak, tiny=False, device=dev, batch=batch)
    if graphs:
        run.graph()
        if graphs == "detached":
            detach_static_outputs(run.model)
    for _ in range(5):
        phased_step(run, None)
    label = f"{name} {'aiak' if aiak else 'O1'}" + (f" graphs {graphs}" if graphs else "")
    print(f"\n=== {label}: {timed_phases(run, steps)}")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        phased_step(run, None)
        torch.cuda.synchronize()
    launches, kernels = 0, 0
    count: Counter[str] = Counter()
    self_us: Counter[str] = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif e.name in LAUNCHES:
            launches += 1
        elif e.name.startswith("aten::") or "aiak" in e.name:
            count[e.name] += 1
            self_us[e.name] += e.self_cpu_time_total
    print(f"{label}: one step: {launches} launch calls, {kernels} GPU events")
    print(f"  ops by self CPU time (count, self ms): {sum(count.values())} op calls")
    for op, us in self_us.most_common(top):
        print(f"    {op:<45} {count[op]:5d}  {us / 1e3:7.2f}")

    python_profile(run, steps, top, f"{label}: cProfile over {steps} steps, by own time")
    if rounds:
        for r in range(rounds):
            print(f"{label} round {r}: {timed_phases(run, steps)}")
        python_profile(run, steps, top, f"{label}: cProfile after {rounds} rounds")
    del run
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="swin_t,resnet50")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--setups", default="o1,aiak", help="o1, aiak or both")
    p.add_argument("--rounds", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--graphs", action="store_const", const="kept", dest="graphs", default="")
    g.add_argument("--graphs-detached", action="store_const", const="detached", dest="graphs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    for name in args.recipes.split(","):
        for setup in args.setups.split(","):
            aiak = setup == "aiak"
            profile_recipe(name, aiak, args.steps, args.top, args.rounds, args.graphs)


if __name__ == "__main__":
    main()
