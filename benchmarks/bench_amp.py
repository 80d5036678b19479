"""aiak.amp O2 vs fp32 and native autocast (O1): training-step speed, peak memory, loss.

On the GPU (torchvision ResNet-50 batch 128 channels_last, timm Swin-T batch 64; all modes in
one process on the same synthetic batch, CUDA events, median of the timed steps)::

    python benchmarks/bench_amp.py --device cuda --steps 200

Modes: ``fp32``; ``o1`` (autocast fp16 + GradScaler); ``o2`` (aiak.amp.decorate + GradScaler);
``o2-fused`` (o2 with a fused optimizer from aiak.optim, when it has one); on request
``o2-patch`` (o2 with ``patch_torch_functions=True``: the user's autocast stays on inside the
half model). For each: median /
p20 / p80 ms per step, images/s, speed-up vs o1, peak memory, mean loss of the last 10 of the
``--steps`` steps, mean loss over all timed steps and its relative gap to o1's, and for o2
modes the time O2 adds around forward+backward (grad copy + unscale + step + copy back, CUDA
events). One CSV row per (model, mode) is appended to ``benchmarks/results/amp.csv``.

``--device cpu --steps 3`` is a smoke mode with a tiny conv net (bf16), used by the tests.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp

RESULTS = Path(__file__).parent / "results" / "amp.csv"
MODES = ("fp32", "o1", "o2", "o2-fused")  # and "o2-patch" when asked for
FIELDS = [
    "timestamp",
    "device",
    "torch",
    "model",
    "mode",
    "batch",
    "steps",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "images_per_s",
    "speedup_vs_o1",
    "peak_mem_gb",
    "final_loss",
    "mean_loss",
    "loss_gap_vs_o1",
    "o2_added_ms",
    "note",
]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: int
    image: int
    channels_last: bool = False


def _resnet50() -> nn.Module:
    import torchvision  # only on the GPU machine

    return torchvision.models.resnet50(weights=None)


def _swin_t() -> nn.Module:
    import timm  # only on the GPU machine

    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)


def _tiny() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


WORKLOADS = {
    "resnet50": Workload("resnet50", _resnet50, 128, 224, channels_last=True),
    "swin_t": Workload("swin_t", _swin_t, 64, 224),
    "tiny": Workload("tiny", _tiny, 8, 32),
}


def fused_optimizer() -> tuple[type[torch.optim.Optimizer] | None, str]:
    """aiak.optim's fused SGD if that subpackage has one (guarded: amp never needs it)."""
    try:
        optim = importlib.import_module("aiak.optim")
    except ImportError as exc:
        return None, f"aiak.optim not importable: {exc}"
    for name in ("FusedSGD", "SGD"):
        cls = getattr(optim, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return cls, f"aiak.optim.{name}"
    return None, "aiak.optim has no fused SGD"


class Timer:
    """CUDA events on the GPU (no host sync inside a step), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def run_mode(
    work: Workload, mode: str, device: torch.device, steps: int, warmup: int, dtype: torch.dtype
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = work.build().to(device)
    fmt = torch.channels_last if work.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(work.batch, 3, work.image, work.image, generator=g)
    x = x.to(device).to(memory_format=fmt)
    y = torch.randint(0, 10, (work.batch,), generator=g).to(device)
    note = ""
    opt_cls: type[torch.optim.Optimizer] = torch.optim.SGD
    if mode == "o2-fused":
        cls, note = fused_optimizer()
        if cls is None:
            return {"note": note, "skipped": True}
        opt_cls = cls
    optimizer = opt_cls(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    o2 = mode.startswith("o2")
    if o2:
        patch = mode == "o2-patch"
        model, optimizer = amp.decorate(model, optimizer, dtype=dtype, patch_torch_functions=patch)
        state = amp.state_of(optimizer)
        note = note or f"backend={state.backend} copies={state.copy_backend}"
    scaler = amp.GradScaler(device.type, enabled=mode != "fp32" and dtype == torch.float16)
    timer = Timer(device)
    copy_marks: list[tuple[Any, Any]] = []
    if o2:
        # Time the grad copy amp does at the end of backward (a final autograd callback).
        # Only mark here; read after the step: a synchronize inside backward stalls the host
        # there and exposes all the host work after it, which an untimed O2 step hides behind
        # the GPU, and would inflate the o2 rows' step times.
        state = amp.state_of(optimizer)
        inner = state._after_backward

        def timed_after_backward() -> None:
            start = timer.mark()
            inner()
            copy_marks.append((start, timer.mark()))

        state._after_backward = timed_after_backward
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_ms, post_ms, losses = [], [], []
    for i in range(warmup + steps):
        t0 = timer.mark()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=mode != "fp32"):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        t1 = timer.mark()
        scaler.step(optimizer)
        scaler.update()
        t2 = timer.mark()
        losses.append(loss.detach())
        if i >= warmup:
            step_ms.append(timer.ms(t0, t2))
            post_ms.append(timer.ms(t1, t2))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    q = statistics.quantiles(step_ms, n=5) if len(step_ms) > 1 else step_ms * 4
    median = statistics.median(step_ms)
    copy_ms = [timer.ms(start, end) for start, end in copy_marks[warmup:]]
    added = statistics.median(post_ms) + (statistics.median(copy_ms) if o2 else 0.0)
    return {
        "median_ms": median,
        "p20_ms": q[0],
        "p80_ms": q[-1],
        "images_per_s": work.batch / median * 1e3,
        "peak_mem_gb": peak,
        "final_loss": torch.stack(losses[-10:]).float().mean().item(),
        # The gap to o1 is taken on the mean over all steps: on one synthetic batch every mode
        # memorises it and the last losses are ~1e-3, where relative gaps mean nothing (fp32
        # itself can end several times off o1 on ResNet-50).
        "mean_loss": torch.stack(losses[warmup:]).float().mean().item(),
        # o2 rows: what O2 adds around forward+backward; o1/fp32 rows: their own step+update.
        "o2_added_ms": added,
        "note": note,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--models", default=None, help="comma list of " + ",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--csv", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --steps 3)")
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    models = args.models or ("resnet50,swin_t" if device.type == "cuda" else "tiny")
    warmup = args.warmup if args.warmup is not None else min(20, args.steps)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    for model_name in models.split(","):
        work = WORKLOADS[model_name]
        results = {
            mode: run_mode(work, mode, device, args.steps, warmup, dtype)
            for mode in args.modes.split(",")
        }
        o1 = results.get("o1", {})
        for mode, r in results.items():
            row = dict.fromkeys(FIELDS, "")
            row.update(
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
                device=name, torch=torch.__version__, model=model_name, mode=mode,
                batch=work.batch, steps=args.steps,
            )  # fmt: skip
            row.update({k: v for k, v in r.items() if k in FIELDS})
            if not r.get("skipped") and o1:
                row["speedup_vs_o1"] = o1["median_ms"] / r["median_ms"]
                row["loss_gap_vs_o1"] = abs(r["mean_loss"] - o1["mean_loss"]) / o1["mean_loss"]
            rows.append(row)
            print(_format(row), flush=True)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    old: list[dict[str, Any]] = []
    if args.csv.exists():
        with args.csv.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != FIELDS:  # written before a column was added: rewrite
                old = [dict.fromkeys(FIELDS, "") | r for r in reader]
    mode = "w" if old or not args.csv.exists() else "a"
    with args.csv.open(mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if mode == "w":
            writer.writeheader()
        writer.writerows(old + rows)
    print(f"appended {len(rows)} rows to {args.csv}")
    return rows


def _format(row: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if isinstance(value, float) else "-"

    return (
        f"{row['model']:>9} {row['mode']:>8}: {num('median_ms', '8.2f')} ms "
        f"[{num('p20_ms', '.2f')}-{num('p80_ms', '.2f')}] {num('images_per_s', '8.1f')} img/s "
        f"x{num('speedup_vs_o1', '.3f')} vs o1, peak {num('peak_mem_gb', '.2f')} GB, "
        f"loss {num('final_loss', '.4f')}, mean {num('mean_loss', '.4f')} "
        f"(gap {num('loss_gap_vs_o1', '.2%')}), "
        f"O2 adds {num('o2_added_ms', '.3f')} ms {row.get('note', '')}"
    )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
