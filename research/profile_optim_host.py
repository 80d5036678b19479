"""Host (CPU) µs per call of the CUDA path's Python, measured on the CPU with the launch stubbed.

    python research/profile_optim_host.py [--steps 50] [--profile] [--cuda]

Not a speed claim: a diagnosis of the Python around the kernel launches, the part of a step the
GPU waits on when the host is slow. The params are tiny (one element per tensor, ResNet-50's
161 tensors and ranks): host cost is per tensor, not per byte.

How the CUDA path runs here without a GPU (:func:`stubbed_launches`): CPU tensors take the
ops' CUDA kernels (``Op.eager_kernel``), the kernel is reported usable, device tables are
built on the CPU, ``get_function`` returns a stand-in and every launch runs ``_driver.Kernel``
in full but for the driver call itself. Everything else is the code that runs on CUDA: the
optimizer's plan checks, the bound step's address checks, the argument packing, version counter
bumps.

Rows:

- per optimizer (FusedAdamW, FusedSGD momentum=0.9, LAMB): ``step()`` on the stubbed CUDA
  path, and on the real CPU path (the ops' references, for scale);
- ``cast_scale_`` (one 1-element tensor) through the stubbed CUDA path vs ``torch.mul(a, s,
  out=b)`` on the CPU: the eager single-tensor launch's Python against a torch op call;
- ``multi_tensor_l2norm`` of 161 tensors (stubbed), the unbound multi-tensor path.

``--profile`` adds cProfile's top functions of the stubbed steps. ``--cuda`` runs the real
steps on CUDA instead: wall µs per step back to back, and this process's CPU time per step.
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
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

import aiak.ops
from aiak.conformance.shapes import RESNET50
from aiak.ops import _capability, _cuda, _driver, _host, _mta, _registry
from aiak.ops._host import any_requires_grad as _any_requires_grad
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


class _Event:
    def record(self, stream: Any = None) -> None:
        pass


def _cpu_table(lists: Any, device: torch.device) -> _mta.Table:
    numels, ptrs, dtypes = _host.parts(lists)
    codes = tuple(tuple(_mta.DTYPE_CODES[d] for d in ds) for ds in dtypes)
    counts = [(m + _mta.CHUNK - 1) // _mta.CHUNK for m in numels[0]]
    words = [w for p in ptrs for w in p] + [c for cs in codes for c in cs] + list(numels[0])
    data = torch.tensor(words, dtype=torch.int64)
    return _mta.Table(data, len(ptrs), len(numels[0]), sum(counts), _Event(), 0, frozenset())


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """The CUDA path's Python on CPU tensors, every launch a no-op (see the module doc)."""
    mp = _Patch()
    mp.set(_registry.Op, "eager_kernel", _cuda_on_cpu)
    # The capability check as on CUDA (env variable, dtypes, CuPy, compute capability).
    mp.set(_capability.Capability, "not_supported_reasons", _reasons_as_on_cuda)
    mp.set(_cuda, "cupy_unavailable_reason", lambda: None)
    mp.set(_cuda, "device_capability", lambda device: (9, 0))
    mp.set(_cuda, "get_function", lambda *a, **k: _STAND_IN)
    mp.set(_driver, "_ex", _no_launch)
    for k in _driver.DECLARED:
        mp.set(k, "_handles", {})
    mp.set(_cuda, "device_index", lambda: 0)
    mp.set(_cuda, "num_sms", lambda device: 132)
    mp.set(torch.cuda, "current_device", lambda: 0)
    mp.set(_mta, "build", _cpu_table)
    mp.set(_mta.Table, "wait", lambda self: None)
    mp.set(torch.cuda, "is_current_stream_capturing", lambda: False)
    mp.set(_cuda, "raw_stream", lambda device: 0)
    _mta.clear_cache()
    try:
        yield
    finally:
        mp.undo()
        _mta.clear_cache()


class _Function:
    """A CuPy function stand-in: a driver handle and the attributes launchers set."""

    kernel = type("Handle", (), {"ptr": 1})()
    num_regs = 96
    max_dynamic_shared_size_bytes = 48 * 1024
    preferred_shared_memory_carveout = -1


_STAND_IN = _Function()


def _no_launch(config: Any, handle: int, params: Any, extra: Any) -> int:
    """cuLaunchKernelEx that launches nothing: the launcher's packing runs as on CUDA."""
    return 0


_real_reasons = _capability.Capability.not_supported_reasons
_CUDA0 = torch.device("cuda", 0)


def _reasons_as_on_cuda(self: _capability.Capability, device: Any, dtypes: Any = ()) -> list:
    return _real_reasons(self, _CUDA0, dtypes)


def _cuda_on_cpu(self: _registry.Op, args: tuple, autograd: bool = True) -> Any:
    """``Op.eager_kernel`` as written, with CPU tensors taking the CUDA branch: the same
    operations, no extra call frame."""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    if (
        type(first) not in _PLAIN
        or (
            autograd
            and self.differentiable
            and torch.is_grad_enabled()
            and _any_requires_grad(args)
        )
        or torch.compiler.is_compiling()
        or _current_dispatch_mode() is not None
    ):
        return None
    if not first.is_cuda:  # the branch CUDA tensors take
        return self.cuda if self.cuda is not None else self.reference
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Patch:
    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


def host_us(fn: Callable[[], Any], steps: int, device: str = "cpu") -> float:
    """Fastest of 30 runs of ``steps`` calls, µs per call: this process's CPU time on the CPU
    (the minimum of many short runs varies ~10% on a small shared box), wall time on CUDA."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    fn()
    runs = []
    gc.collect()
    gc.disable()  # as timeit does: a collection inside one run is not the call's cost
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


def paired_us(f: Callable[[], Any], g: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Fastest of 30 interleaved runs of ``calls`` calls each of ``f`` and ``g``, µs per call
    (CPU time): both see the same machine load, so their ratio holds on a busy box."""
    f(), g()
    best = [float("inf"), float("inf")]
    gc.collect()
    gc.disable()
    for _ in range(30):
        for k, fn in enumerate((f, g)):
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            best[k] = min(best[k], (time.process_time() - t0) / calls * 1e6)
    gc.enable()
    return best[0], best[1]


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


def rows_cpu(steps: int) -> list[tuple[str, str, float]]:
    rows = []
    for name, make in OPTIMIZERS.items():
        with stubbed_launches():
            opt = make(tiny_params())
            rows.append((name, "step, CUDA path (launch stubbed)", host_us(opt.step, steps)))
        opt = make(tiny_params())
        rows.append((name, "step, CPU (the ops' references)", host_us(opt.step, steps)))
    a, b = torch.ones(1), torch.empty(1)
    half = torch.empty(1, dtype=torch.float16)
    with stubbed_launches():
        gs = [p.grad for p in tiny_params()]
        with torch.no_grad():
            us = host_us(lambda: aiak.ops.multi_tensor_l2norm(gs), steps)
        rows.append(("multi_tensor_l2norm", "161 grads, CUDA path (stubbed)", us))
        cast, mul = paired_us(
            lambda: aiak.ops.cast_scale_(half, a, 2.0),
            lambda: torch.mul(a, 2.0, out=b),
            steps * 20,
        )
    rows.append(("cast_scale_", "CUDA path (launch stubbed)", cast))
    rows.append(("torch.mul(a, s, out=b)", "CPU, 1 element", mul))
    rows.append(("cast_scale_ / torch.mul", "ratio (interleaved runs)", cast / mul))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cuda:
        rows = []
        for name, make in OPTIMIZERS.items():
            opt = make(tiny_params("cuda"))
            rows.append((name, "CUDA, back to back (wall)", host_us(opt.step, args.steps, "cuda")))
            rows.append((name, "CUDA, host CPU time", host_us(opt.step, args.steps)))
        a, b = torch.ones(1, device="cuda"), torch.empty(1, device="cuda", dtype=torch.float16)
        rows.append(
            (
                "cast_scale_",
                "CUDA, host CPU time",
                host_us(lambda: aiak.ops.cast_scale_(b, a, 2.0), args.steps * 20),
            )
        )
        rows.append(
            (
                "torch.mul(a, s, out=b)",
                "CUDA, host CPU time",
                host_us(lambda: torch.mul(a, 2.0, out=b), args.steps * 20),
            )
        )
    else:
        rows = rows_cpu(args.steps)
    print(f"host µs per call, {len(RESNET50)} tensors, torch {torch.__version__}")
    print(f"{'what':24s} {'path':36s} {'µs':>9s}")
    for name, label, us in rows:
        print(f"{name:24s} {label:36s} {us:9.1f}")
    if args.profile and not args.cuda:
        for name, make in OPTIMIZERS.items():
            with stubbed_launches():
                opt = make(tiny_params())
                opt.step()
                print(f"\n== {name}, CUDA path (launch stubbed), cProfile top functions")
                print(top_functions(opt.step, 200))


if __name__ == "__main__":
    main()
