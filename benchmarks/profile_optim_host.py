"""Host (CPU) µs per ``step()`` of aiak's optimizers on ResNet-50's 161 tensors, by stage.

    python benchmarks/profile_optim_host.py [--steps 50] [--profile] [--cuda]

Not a speed claim: a diagnosis of the Python work around the kernel launches, the part of a
step the GPU waits on when the host is slow (on the H100 machine ~1-2 µs per Python-level
per-tensor operation; here, on a CPU-only box, less). The params are tiny (one element per
tensor, ResNet-50's tensor count and ranks): host cost is per tensor, not per byte.

Rows, per optimizer (FusedAdamW, FusedSGD momentum=0.9, LAMB weight_decay=0.01):

- ``kernel path``: ``step()`` as it runs on CUDA, with the aiak ops replaced by no-ops
  (``aiak.optim._common.use_ops`` forced on, ``op(name)`` returning a stub): everything the
  optimizer does in Python around the launches, nothing of the launchers.
- ``+ ops table key``: the same, with the stub also computing ``aiak.ops._mta.key`` over the
  lists it is handed, the per-call lookup every CUDA launcher does (``_checked_table`` /
  ``_validated_table``) before a cached launch: the ops-side host floor per call.
- ``foreach (CPU)``: the real CPU step (torch._foreach ops on one-element tensors).
- ``torch.ops dispatch of Tensor[161]``: what one list argument costs through the dispatcher
  (an op called as ``torch.ops.aiak.x`` instead of its eager fast path).

``--profile`` adds cProfile's top functions (by own time) of the kernel-path step. ``--cuda``
runs the real step on CUDA instead of the stubs: wall µs per step back to back (max of host
and GPU), and this process's CPU time per step (the host's share, launchers included).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
import aiak.optim._common as C
from aiak.conformance.shapes import RESNET50
from aiak.ops import _mta
from aiak.optim import LAMB, FusedAdamW, FusedSGD

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "FusedAdamW": lambda ps: FusedAdamW(ps, lr=1e-3, weight_decay=0.01),
    "FusedSGD(momentum)": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "LAMB": lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01),
}


def tiny_params(device: str = "cpu") -> list[torch.Tensor]:
    """ResNet-50's 161 tensors (same ranks), one element each, with grads."""
    ps = [torch.randn([1] * len(s), device=device).requires_grad_() for s in RESNET50]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _lists(args: tuple) -> list[list[torch.Tensor]]:
    return [list(a) for a in args if isinstance(a, (list, tuple)) and a]


def _stub(name: str, key: bool) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        if key:
            _mta.key(name, _lists(args))
        if name == "multi_tensor_l2norm":
            n = len(args[0]) if args[1] else 0
            return torch.zeros(()), torch.zeros(n)
        return None

    return kernel


@contextlib.contextmanager
def stubbed_kernels(key: bool) -> Iterator[None]:
    """The CUDA path's Python on the CPU: ``use_ops`` on, every aiak op a no-op."""
    saved = (C.use_ops, C.op, torch.ops.aiak.multi_tensor_l2norm)
    C.use_ops = lambda device: True
    C.op = lambda name: _stub(name, key)
    # Code that calls torch.ops.aiak.multi_tensor_l2norm directly (through the dispatcher).
    torch.ops.aiak.multi_tensor_l2norm = _stub("multi_tensor_l2norm", key)
    try:
        yield
    finally:
        C.use_ops, C.op, torch.ops.aiak.multi_tensor_l2norm = saved


def host_us(fn: Callable[[], Any], steps: int, device: str = "cpu") -> float:
    """Fastest of 30 runs of ``steps`` calls, µs per call. On the CPU: this process's CPU time
    (``time.process_time``), and the minimum of many short runs: on a small shared box (2
    cores, other jobs) the median of 5 long wall-clock runs of the same code varied 1.5-2x
    between invocations; the minimum of 30 short ones varies ~10%. With ``--cuda``: wall
    time, steps back to back."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    fn()
    runs = []
    gc.collect()
    gc.disable()  # as timeit does: a collection inside one run is not the step's cost
    for _ in range(30):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append((clock() - t0) / steps * 1e6)
    gc.enable()
    return min(runs)


def dispatch_us(steps: int) -> float:
    """Host µs of a no-op custom op taking one Tensor[] of 161, called through torch.ops."""
    lib = torch.library.Library("aiak_profile", "FRAGMENT")
    lib.define("noop(Tensor[] ts) -> ()")
    lib.impl("noop", lambda ts: None, "CompositeExplicitAutograd")
    ts = tiny_params()
    call = torch.ops.aiak_profile.noop
    return host_us(lambda: call(ts), steps)


def top_functions(fn: Callable[[], Any], steps: int, lines: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    text = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(text) if "ncalls" in line)
    return "\n".join(text[start : start + lines + 1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, make in OPTIMIZERS.items():
        if args.cuda:
            opt = make(tiny_params("cuda"))
            rows.append((name, "CUDA, back to back (wall)", host_us(opt.step, args.steps, "cuda")))
            rows.append((name, "CUDA, host CPU time", host_us(opt.step, args.steps)))
            continue
        for label, key in (("kernel path", False), ("+ ops table key", True)):
            with stubbed_kernels(key):
                opt = make(tiny_params())
                rows.append((name, label, host_us(opt.step, args.steps)))
        opt = make(tiny_params())
        rows.append((name, "foreach (CPU)", host_us(opt.step, args.steps)))
    if not args.cuda:
        rows.append(("-", "torch.ops dispatch of Tensor[161]", dispatch_us(args.steps)))
    print(f"host µs per step, {len(RESNET50)} tensors, torch {torch.__version__}")
    print(f"{'optimizer':20s} {'path':36s} {'µs/step':>9s}")
    for name, label, us in rows:
        print(f"{name:20s} {label:36s} {us:9.1f}")
    if args.profile and not args.cuda:
        for name, make in OPTIMIZERS.items():
            with stubbed_kernels(False):
                opt = make(tiny_params())
                opt.step()
                print(f"\n== {name}, kernel path, cProfile top functions over 200 steps")
                print(top_functions(opt.step, 200))


if __name__ == "__main__":
    main()
