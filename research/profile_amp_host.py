"""Host (CPU) microseconds per training step that each O2 stage costs: o1 vs o2, per backend.

    python research/profile_amp_host.py                  # CPU, tiny ResNet-50-shaped params
    python research/profile_amp_host.py --device cuda    # the same on a GPU (real aiak kernel)

Why: on the H100 machine the GradScaler's ``found_inf.item()`` makes the host finish every
post-backward Python statement while the GPU idles, and its host pays ~1-2 µs per Python-level
per-tensor operation. Host cost is per tensor, not per byte, so the model here has ResNet-50's
161 parameters (``aiak.conformance.shapes.RESNET50``: 53 convs, 53 BatchNorms, the fc) with
every tensor cut to at most ``--numel`` elements; BatchNorm params sit in real ``BatchNorm1d``
modules so ``decorate`` keeps them fp32 exactly as in ResNet-50 (55 masters, 106 fp32 params).

Stages, timed with ``perf_counter`` around each call (on cuda the device is synchronised
before each stage, so a stage's time is its own host work; only ``step`` waits, on the
GradScaler's ``.item()`` of a few-µs unscale kernel):

- zero_grad (torch): ``optimizer.zero_grad`` minus amp's part; zero_grad (amp): amp's
  ``zero_model_grads`` (the half model's grads).
- forward: the autocast forward (not an O2 cost; for scale).
- backward (excl. copy): ``scaler.scale(loss).backward()`` minus amp's end-of-backward
  callback: autograd plus amp's per-param post-accumulate-grad hooks.
- grad copy (amp): the callback that mirrors the half grads into the fp32 master grads.
- unscale_: ``scaler.unscale_(optimizer)``; step (torch): ``scaler.step`` minus amp's hooks;
  step hooks (amp): ``before_step`` + ``after_step`` without the copy-back; copy-back (amp).
- update: ``scaler.update()`` (amp's O2 policy wrapper included for o2).

Modes: ``o1`` (fp32 model, autocast fp16, GradScaler: the baseline); ``o2``
(``aiak.amp.decorate`` with its defaults); ``o2-foreach`` and ``o2-aiak`` (every copy through
that multi-tensor backend: ``state.backend`` and ``state.copy_backend``). On the CPU the aiak op has
no kernel of its own (its PyTorch reference walks the tensors in Python, which is not what a
GPU step pays), so ``o2-aiak`` there runs a stand-in CPU kernel doing the CUDA launcher's host
work (the validated-table cache lookup, or full validation on a miss) and then the math with
``torch._foreach_*``; ``--aiak-reference`` uses the real reference instead.

Not a speed claim: a diagnosis of where host time goes. ``--cprofile MODE`` adds a cProfile of
that mode's steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import aiak.amp as amp
from aiak.amp import _multi_tensor
from aiak.conformance.shapes import RESNET50

MODES = ("o1", "o2", "o2-foreach", "o2-aiak")
STAGES = (
    "zero_grad (torch)",
    "zero_grad (amp)",
    "forward",
    "backward (excl. copy)",
    "grad copy (amp)",
    "unscale_",
    "step (torch)",
    "step hooks (amp)",
    "copy-back (amp)",
    "update",
)
MATH = "(stand-in kernel math)"  # reported apart, in no total
# The stages that exist because of O2 (what an o2 column adds over o1 is the total's gap).
AMP_STAGES = ("zero_grad (amp)", "grad copy (amp)", "step hooks (amp)", "copy-back (amp)")


class TinyResNet50Params(nn.Module):
    """ResNet-50's 161 parameters, each cut to at most ``cap`` elements, in the same order and
    module kinds (a conv weight in a bias-free Linear, a BatchNorm pair in a BatchNorm1d,
    the fc as a Linear). The forward touches every parameter once so each gets a grad."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        shapes = list(RESNET50)
        i = 0
        while i < len(shapes):
            shape = shapes[i]
            n = min(math.prod(shape), cap)
            if len(shape) == 4:  # conv weight, followed by its BatchNorm's weight and bias
                layers.append(nn.Linear(n, 1, bias=False))
                layers.append(nn.BatchNorm1d(min(shapes[i + 1][0], cap)))
                i += 3
            elif len(shape) == 2:  # fc weight and bias
                layers.append(nn.Linear(min(shape[1], cap), min(shape[0], cap)))
                i += 2
            else:
                raise AssertionError(f"unexpected shape {shape}")
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.sum()
        for layer in self.layers:
            for p in layer.parameters(recurse=False):
                out = out + p.sum()
        return out


def _standin_aiak_kernel() -> Any:
    """A CPU kernel for ``aiak::multi_tensor_scale_`` with the CUDA launcher's host work: the
    validated-table lookup by (numels, addresses, dtypes) for contiguous sets, full argument
    validation on a miss; then the math through ``torch._foreach_*``."""
    from aiak.ops import _capability, _mta, multi_tensor
    from aiak.ops._registry import increment_version

    fake_table = types.SimpleNamespace(wait=lambda: None)
    dtype_of = multi_tensor._dtype

    def kernel(
        src: list[torch.Tensor], dst: list[torch.Tensor], scale: torch.Tensor, found: torch.Tensor
    ) -> None:
        dtypes = set(map(dtype_of, src)) | set(map(dtype_of, dst))
        hit = multi_tensor._validated_table("scale", [src, dst]) if src else None
        if hit is not None:
            _capability.check_scalar_tensor("s", "scale", scale, None, torch.float32)
            _capability.check_scalar_tensor("s", "found_inf", found, None, torch.float32)
        else:
            multi_tensor._check_scale_args(src, dst, scale, found)
            if not src:
                return
            if all(map(multi_tensor._all_contiguous, [src, dst])):
                _mta._cache[_mta.key("scale", [src, dst])] = fake_table
        # The math (one launch on the GPU whatever the set), timed apart: not host overhead.
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        if dtypes == {torch.float32} or (dst and dst[0].dtype == torch.float32):
            torch._amp_foreach_non_finite_check_and_unscale_(dst, found, scale)
        timer = StageTimer.current
        if timer is not None and timer.stack:
            timer.math[timer.stack[-1]] += time.perf_counter() - t0
        increment_version(dst)
        increment_version(found)

    lib = torch.library.Library("aiak", "IMPL")
    lib.impl("multi_tensor_scale_", kernel, "CPU")
    return lib  # keep it alive: the registration lasts as long as the Library object


class StageTimer:
    """Accumulates host seconds per stage for the current step. ``math`` collects, per wrapped
    stage, the seconds the CPU stand-in kernel spent on arithmetic (a GPU's job, not host
    overhead), which the report takes out of that stage."""

    current: StageTimer | None = None

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.now: dict[str, float] = defaultdict(float)
        self.math: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []
        StageTimer.current = self

    def wrap(self, obj: Any, name: str, stage: str) -> None:
        """Time ``obj.name`` (an instance attribute shadows the class method)."""
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(stage)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[stage] += time.perf_counter() - t0
                self.stack.pop()

        setattr(obj, name, timed)

    def run(self, stage: str, fn: Callable[[], Any]) -> Any:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.now[stage] += time.perf_counter() - t0
        return out


def profile_mode(
    mode: str, device: torch.device, steps: int, warmup: int, cap: int, set_to_none: bool
) -> tuple[dict[str, float], cProfile.Profile | None, int]:
    torch.manual_seed(0)
    model = TinyResNet50Params(cap).to(device)
    # foreach=True: what torch picks on CUDA (on the CPU it would default to a per-tensor loop).
    opt = torch.optim.SGD(
        model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4, foreach=True
    )
    state = None
    if mode != "o1":
        model, opt = amp.decorate(model, opt, dtype=torch.float16)
        state = amp.state_of(opt)
        if mode != "o2":  # o2: amp's defaults
            state.backend = state.copy_backend = mode.removeprefix("o2-")
    scaler = amp.GradScaler(device.type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timer = StageTimer(sync)
    if state is not None:
        timer.wrap(state, "_after_backward", "grad copy (amp)")
        timer.wrap(state, "copy_masters_to_model", "copy-back (amp)")
        timer.wrap(state, "before_step", "step hooks (amp)")
        timer.wrap(state, "after_step", "step hooks (amp)")
        timer.wrap(state, "zero_model_grads", "zero_grad (amp)")
    x = torch.randn(2, 4, device=device)
    per_stage: dict[str, list[float]] = defaultdict(list)
    totals: list[float] = []
    prof = cProfile.Profile()
    skipped_before = state.skipped_steps if state else 0
    for i in range(warmup + steps):
        timer.now.clear()
        timer.math.clear()
        if i == warmup:
            prof.enable()

        def fwd() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.float16):
                return model(x)

        timer.run("zero_grad (torch)", lambda: opt.zero_grad(set_to_none=set_to_none))
        loss = timer.run("forward", fwd)
        timer.run("backward (excl. copy)", lambda loss=loss: scaler.scale(loss).backward())
        timer.run("unscale_", lambda: scaler.unscale_(opt))
        timer.run("step (torch)", lambda: scaler.step(opt))
        timer.run("update", lambda: scaler.update())
        now = dict(timer.now)
        # Nested timers: report each part once.
        now["zero_grad (torch)"] -= now.get("zero_grad (amp)", 0.0)
        now["backward (excl. copy)"] -= now.get("grad copy (amp)", 0.0)
        now["step hooks (amp)"] = now.get("step hooks (amp)", 0.0) - now.get("copy-back (amp)", 0)
        now["step (torch)"] -= now.get("step hooks (amp)", 0.0) + now.get("copy-back (amp)", 0)
        for stage, seconds in timer.math.items():
            now[stage] -= seconds
        now[MATH] = sum(timer.math.values())
        if i >= warmup:
            for stage in (*STAGES, MATH):
                per_stage[stage].append(now.get(stage, 0.0) * 1e6)
            totals.append(sum(now.get(s, 0.0) for s in STAGES) * 1e6)
    prof.disable()
    sync()
    medians = {s: statistics.median(v) for s, v in per_stage.items()}
    medians["total"] = statistics.median(totals)
    skipped = (state.skipped_steps - skipped_before) if state else 0
    return medians, prof, skipped


def format_table(results: dict[str, dict[str, float]], modes: Sequence[str]) -> str:
    lines = [f"{'host µs / step':24s}" + "".join(f"{m:>14s}" for m in modes)]
    for stage in (*STAGES, "total", MATH):
        lines.append(
            f"{stage:24s}" + "".join(f"{results[m].get(stage, float('nan')):14.1f}" for m in modes)
        )
    if "o1" in results:
        lines.append(
            f"{'total - o1 total':24s}"
            + "".join(f"{results[m]['total'] - results['o1']['total']:14.1f}" for m in modes)
        )
    lines.append(
        f"{'amp stages':24s}"
        + "".join(f"{sum(results[m].get(s, 0.0) for s in AMP_STAGES):14.1f}" for m in modes)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor, at most")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--set-to-none", default="both", choices=["both", "true", "false"])
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per mode; each stage's least median is kept"
    )
    parser.add_argument("--aiak-reference", action="store_true")
    parser.add_argument("--cprofile", default=None, help="a mode to cProfile (top 20, tottime)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    modes = [m for m in args.modes.split(",") if m]
    if "o2-aiak" in modes and _multi_tensor.default_backend() != "aiak":
        print("aiak.ops is not importable: dropping o2-aiak")
        modes.remove("o2-aiak")
    keep = None
    if device.type == "cpu" and "o2-aiak" in modes and not args.aiak_reference:
        keep = _standin_aiak_kernel()
    choices = {"both": (True, False), "true": (True,), "false": (False,)}[args.set_to_none]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for set_to_none in choices:
        results, profiles = {}, {}
        # Modes interleaved, repeated, least median kept: a shared host's noise only adds.
        for _ in range(args.repeat):
            for mode in modes:
                medians, profiles[mode], skipped = profile_mode(
                    mode, device, args.steps, args.warmup, args.numel, set_to_none
                )
                if skipped:
                    print(f"note: {mode} skipped {skipped} steps (overflow)")
                best = results.setdefault(mode, medians)
                for stage, value in medians.items():
                    best[stage] = min(best[stage], value)
        print(
            f"\n== {device.type}, 161 ResNet-50-shaped params of <= {args.numel} elements, "
            f"zero_grad(set_to_none={set_to_none}), least of {args.repeat} medians of "
            f"{args.steps} steps"
            + (", o2-aiak on the CPU stand-in kernel" if keep is not None else "")
        )
        print(format_table(results, modes))
        if args.cprofile in profiles:
            s = io.StringIO()
            pstats.Stats(profiles[args.cprofile], stream=s).sort_stats("tottime").print_stats(20)
            print("\n".join(s.getvalue().splitlines()[:40]))
        out[str(set_to_none)] = results
    del keep
    return out


if __name__ == "__main__":
    main()
