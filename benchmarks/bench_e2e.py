"""End to end: each recipe of examples/recipes/ in four modes, in one process, interleaved.

    python benchmarks/bench_e2e.py [--recipes swin_t,resnet50,bert_lamb,yolox_simota]
                                   [--warmup 10] [--rounds 3] [--steps 10]
    python benchmarks/bench_e2e.py --quick      # CPU smoke run: tiny torch.nn models

Modes: ``o1`` (torch.autocast + GradScaler, torch's optimizer: what a user has), ``o1_compile``
(the same model under ``torch.compile``), ``aiak`` (the recipe's aiak set-up: O2, fused
optimizer, the recipe's op), ``aiak_compile``. All four are built from the same initial
weights and data; each warms up ``--warmup`` steps (compilation included), then ``--rounds``
rounds run ``--steps`` steps of every mode in turn (the order rotates per round), each timed
from the host around its steps (synchronised). Per mode: the median step time over the rounds,
the speed-up against ``o1`` and against ``o1_compile``, the peak memory of the step above what
was allocated before it, the model + optimizer state, and the loss after all its steps next
to ``o1``'s (the modes train the same steps on the same data; aiak's optimizer may differ from
the baseline's: LAMB vs AdamW in bert_lamb). Rows go to ``<out>/e2e.csv`` (default
benchmarks/results/), a PNG of the speed-ups next to it when matplotlib is installed.

Rows are appended after each recipe, so a run cut short keeps the recipes it finished; under a
time limit, run the recipes in two calls (``--recipes swin_t,resnet50``, then
``--recipes bert_lamb,yolox_simota``): each compiles two models per recipe.

``--compile-mode reduce-overhead`` (any ``torch.compile`` mode) compiles both compiled modes
that way: with CUDA graphs a host-bound step shows its kernels' time, so the same recipe under
both modes tells how much of a compiled step is the host's (the ``compile_mode`` column).
``--graphs`` (CUDA) adds ``o1_graphs`` and ``aiak_graphs``: the eager set-ups with the model's
forward and backward replayed from CUDA graphs (the recipes' ``Run.graph``), no compiler.
``--modes`` times a subset of the six (``vs_o1`` / ``vs_o1_compile`` are NaN without
their baseline).

``--ddp`` (under ``torchrun`` or ``aiakrun -np N``) wraps every mode's model in
DistributedDataParallel on the launcher's process group, in the recipes' order: graphed, then
wrapped, then compiled (``torch.compile(ddp_model)``); every rank runs the same rounds, rank 0
reports (the ``ddp`` and ``world_size`` columns). Under a launcher without ``--ddp`` each rank
would time its own single-GPU copy, so ``--ddp`` is required there.

A recipe whose model needs timm or torchvision is skipped, with the reason printed and kept
in the CSV, when the package is missing (``--quick`` needs neither).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS, environment, print_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))
from _recipe import COMPILE_MODES  # noqa: E402  (the recipes' folder is on the path above)

RECIPES = {  # name -> (package the full-size model needs, full batch, quick batch)
    "swin_t": ("timm", 64, 4),
    "resnet50": ("torchvision", 128, 8),
    "bert_lamb": (None, 256, 8),
    "yolox_simota": (None, 64, 4),
}
MODES = ("o1", "o1_compile", "aiak", "aiak_compile")
GRAPH_MODES = ("o1_graphs", "aiak_graphs")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(run: Any) -> int:
    """Bytes of the model's params and buffers, their grads, the optimizer's params (fp32
    masters under O2) and its state, each storage counted once."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for t in (*run.model.parameters(), *run.model.buffers()):
        add(t)
        add(getattr(t, "grad", None))
    for g in run.optimizer.param_groups:
        for p in g["params"]:
            add(p)
            add(p.grad)
    for st in run.optimizer.state.values():
        for v in st.values():
            add(v)
    return sum(seen.values())


def _steps(run: Any, n: int) -> tuple[float, float, int]:
    """(ms per step, last loss, peak bytes above the allocation before) of ``n`` steps."""
    dev = run.device
    _sync(dev)
    base = 0
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    loss = None
    for _ in range(n):
        loss = run.step()
    _sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / n
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return ms, float(loss), peak


def bench_recipe(name: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    need, batch, quick_batch = RECIPES[name]
    batch = args.batch or (quick_batch if args.quick else batch)
    if not args.quick and need and importlib.util.find_spec(need) is None:
        reason = f"skipped: {need} is not installed (run with --quick for the torch.nn models)"
        print(f"{name}: {reason}")
        return [{"recipe": name, "mode": "", "status": reason}]
    recipe = importlib.import_module(name)
    modes = args.modes
    runs = {}
    for mode in modes:
        run = recipe.build(
            aiak=mode.startswith("aiak"), tiny=args.quick, device=device, batch=batch
        )
        if mode.endswith("graphs"):
            run.graph()  # before DDP wraps the model (Run.graph)
        if args.ddp:
            run.ddp()
        if mode.endswith("compile"):
            run.compile(backend=args.backend, mode=args.compile_mode)
        runs[mode] = run
    compile_s = {}
    for mode, run in runs.items():  # warm-up: compilation, allocator, autotuning
        t0 = time.perf_counter()
        _steps(run, args.warmup)
        compile_s[mode] = time.perf_counter() - t0
        if _rank() == 0:
            print(f"{name} {mode}: warm-up {compile_s[mode]:.1f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, int] = dict.fromkeys(modes, 0)
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            ms, loss, peak = _steps(runs[mode], args.steps)
            times[mode].append(ms)
            peaks[mode] = max(peaks[mode], peak)
            losses[mode] = loss
    med = {m: statistics.median(v) for m, v in times.items()}
    rows = []
    for mode in modes:
        rows.append(
            {
                "recipe": name,
                "mode": mode,
                "status": "ok",
                "batch": batch,
                "backend": args.backend,
                "compile_mode": args.compile_mode or "default",
                "ddp": args.ddp,
                "world_size": _world_size() if args.ddp else 1,
                "ms_step": med[mode],
                "ms_rounds": " ".join(f"{t:.2f}" for t in times[mode]),
                "vs_o1": med.get("o1", math.nan) / med[mode],
                "vs_o1_compile": med.get("o1_compile", math.nan) / med[mode],
                "step_peak_mib": peaks[mode] / 2**20,
                "state_mib": _state_bytes(runs[mode]) / 2**20,
                "loss": losses[mode],
                "loss_vs_o1": losses[mode] / losses["o1"] if losses.get("o1") else math.nan,
                "warmup_s": compile_s[mode],
                "steps": args.warmup + args.rounds * args.steps,
            }
        )
    del runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _init_ddp(device: torch.device) -> torch.device:
    """The launcher's process group (NCCL on CUDA, gloo on a CPU); this rank's device."""
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # compilation runs between the warm-up's collectives: minutes, not torch's 30 (gloo)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10)
    )
    return device


def _write(rows: list[dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "e2e.csv"
    env = environment()
    rows = [{**env, **r} for r in rows]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    old: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old = list(reader)
            fields = list(reader.fieldnames or []) + [
                c for c in fields if c not in (reader.fieldnames or [])
            ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(old)
        writer.writerows(rows)
    return path


def _plot(rows: list[dict], out: Path) -> Path | None:
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    recipes = list(dict.fromkeys(r["recipe"] for r in ok))
    if not recipes:
        return None
    fig, ax = plt.subplots(figsize=(2 + 2 * len(recipes), 3.5))
    modes = [m for m in MODES + GRAPH_MODES if any(r["mode"] == m for r in ok)]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [
            next((r["vs_o1"] for r in ok if r["recipe"] == n and r["mode"] == mode), math.nan)
            for n in recipes
        ]
        ax.bar([k + i * width for k in range(len(recipes))], ys, width, label=mode)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(recipes))], recipes)
    ax.set_ylabel("step speed vs O1 eager")
    ax.set_title(f"bench_e2e on {ok[0].get('gpu') or environment()['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "e2e.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing (compile)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    p.add_argument("--batch", type=int, default=None, help="override every recipe's batch")
    p.add_argument("--quick", action="store_true", help="tiny torch.nn models (CPU smoke run)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--compile-mode",
        default=None,
        choices=COMPILE_MODES,
        help="torch.compile's mode for both compiled modes (default: torch's default)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also o1_graphs and aiak_graphs: the eager modes replayed from CUDA graphs (CUDA)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated subset of {','.join(MODES + GRAPH_MODES)} (default: the four, "
        "and the two graphed ones with --graphs)",
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        help="every mode's model in DDP (under torchrun / aiakrun -np N; rank 0 reports)",
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of e2e.csv / e2e.png")
    args = p.parse_args(argv)
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}")
    for flag in ("warmup", "rounds", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.modes is None:
        args.modes = MODES + (GRAPH_MODES if args.graphs else ())
    else:
        args.modes = tuple(m for m in args.modes.split(",") if m)
        bad = [m for m in args.modes if m not in MODES + GRAPH_MODES]
        if bad or not args.modes or len(set(args.modes)) != len(args.modes):
            p.error(f"--modes: {args.modes} must be distinct modes of {MODES + GRAPH_MODES}")
    if args.graphs and device.type != "cuda":
        p.error(f"--graphs needs a CUDA device, got {device}")
    if set(args.modes) & set(GRAPH_MODES) and device.type != "cuda":
        p.error(f"--modes: the graphed modes need a CUDA device, got {device}")
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if args.ddp and not launched:
        p.error("--ddp runs under a launcher: torchrun or aiakrun -np N -- python bench_e2e.py")
    if launched and _world_size() > 1 and not args.ddp:
        p.error("under a launcher with several ranks, pass --ddp (else each rank times a copy)")
    if args.ddp:
        device = _init_ddp(device)
    try:
        rows = _bench(names, args, device)
    finally:
        if args.ddp:
            torch.distributed.destroy_process_group()  # after bench_recipe dropped its models
    return rows


def _bench(names: list[str], args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    path = args.out / "e2e.csv"
    for name in names:
        recipe_rows = bench_recipe(name, args, device)
        if _rank() == 0:  # per recipe: a run cut short keeps what it did
            path = _write(recipe_rows, args.out)
        rows += recipe_rows
    if _rank() != 0:
        return rows
    cols = ["recipe", "mode", "ms_step", "vs_o1", "vs_o1_compile", "step_peak_mib"]
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        print_table(ok, [*cols, "state_mib", "loss", "loss_vs_o1", "warmup_s"])
    png = _plot(rows, args.out)
    print(f"rows -> {path}" + (f", plot -> {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()
