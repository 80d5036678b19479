"""aiak-advise's op accounting: what an op's work is, and what an op costs on this machine.

:func:`counting` is a dispatch mode that hands every op to a callback; :func:`work` measures
an op's work (elements written, multiply-adds of matmuls and convolutions); :func:`rates` and
:func:`op_cost` calibrate the seconds per element, per multiply-add and per op with no work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["copy_rate", "counting", "link", "op_cost", "precision", "rates", "storage_ptr", "work"]


def counting(on_op: Callable[[Any, Any, Any], None]) -> Any:
    """A dispatch mode that runs each op, then calls ``on_op(func, args, out)``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **(kwargs or {}))
            on_op(func, args, out)
            return out

    return _Count()


_MM = ("mm", "addmm", "bmm", "baddbmm")


def work(func: Any, args: Any, out: Any) -> tuple[int, int]:
    """(elements written, multiply-adds) of one op: the work the op's time is made of."""
    import torch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    elems = sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    macs = 0
    if name in _MM and isinstance(outs[0], torch.Tensor):
        a = args[1] if name.startswith(("add", "badd")) else args[0]
        macs = outs[0].numel() * int(a.shape[-1])
    elif name == "convolution" and isinstance(outs[0], torch.Tensor):
        macs = outs[0].numel() * int(args[1][0].numel())
    elif name == "convolution_backward" and isinstance(args[0], torch.Tensor):
        macs = 2 * args[0].numel() * int(args[2][0].numel())  # input and weight gradients
    return elems, macs


def precision(func: Any, args: Any, out: Any, weights: Collection[int]) -> tuple[int, int, int]:
    """What O2 would change in one op: (elements it casts from one float dtype to another,
    of those the fp32 weights cast to half (``weights``: their ``data_ptr()``), fp32 elements
    written by an op that is not a cast). Autocast's casts reach the dispatcher as
    ``_to_copy``; its fp32-list ops (layer_norm, softmax, ...) write fp32 outputs."""
    import torch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    first = args[0] if args else None
    if name == "_to_copy" and isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor):
        if first.is_floating_point() and out.is_floating_point() and first.dtype != out.dtype:
            weight = first.dtype == torch.float32 and storage_ptr(first) in weights
            return out.numel(), out.numel() if weight else 0, 0
        return 0, 0, 0
    fp32 = sum(t.numel() for t in outs if isinstance(t, torch.Tensor) and t.dtype == torch.float32)
    return 0, 0, fp32


def storage_ptr(t: Any) -> int | None:
    """A tensor's storage address; None for one that has none (a meta or wrapper tensor)."""
    try:
        return int(t.data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def rates(torch: Any) -> dict[str, float]:
    """Seconds per element written by an elementwise op and per multiply-add of a matmul of
    a small batch, on the CPU (best of five)."""
    a, b, c = torch.randn(2**20), torch.randn(2**20), torch.empty(2**20)
    x, w = torch.randn(64, 256), torch.randn(256, 256)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {
        "elem_s": best(lambda: torch.add(a, b, out=c)) / 2**20,
        "mac_s": best(lambda: torch.mm(x, w)) / (64 * 256 * 256),
    }


def copy_rate(torch: Any, nbytes: int = 2**28) -> float:
    """Bytes per second a device-to-device copy moves on the current GPU (read + write: a copy
    of ``nbytes`` moves ``2 * nbytes``), timed with CUDA events, best of five. The rate that
    turns the bytes a change saves into time: the ops it acts on (casts, fp32 elementwise ops,
    an optimizer's passes over its state) are bound by memory bandwidth, as a copy is."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    best = float("inf")
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best if best > 0 else 0.0


def op_cost(torch: Any, device: str) -> float:
    """Seconds one op costs the host when it has no work: a chain of multiplications of
    one-element tensors and its backward, timed, divided by the ops it dispatches."""
    dev = torch.device("cuda") if device == "cuda" and torch.cuda.is_available() else "cpu"
    w = torch.ones(1, device=dev, requires_grad=True)
    x = torch.ones(1, device=dev)

    def chain() -> None:
        y = x
        for _ in range(100):
            y = y * w
        torch.autograd.grad(y.sum(), w)  # not .backward(): the probe times that one

    chain()  # warm
    counted = {"n": 0}

    def count(func: Any, args: Any, out: Any) -> None:
        counted["n"] += 1

    with counting(count):
        chain()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        chain()
        best = min(best, time.perf_counter() - t0)
    return best / max(1, counted["n"])


def link(torch: Any, nbytes: int, device: str) -> dict[str, float]:
    """The default group's allreduce, timed after a barrier (so that no rank waits for
    another): its latency (one element, best of five) and its seconds per byte of buffer
    (``nbytes``, best of three). Every rank must call it."""
    dist = torch.distributed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def best(t: Any, reps: int) -> float:
        out = float("inf")
        for _ in range(reps):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            sync()
            out = min(out, time.perf_counter() - t0)
        return out

    n = max(1, nbytes // 4)
    latency = best(torch.zeros(1, device=device), 5)
    full = best(torch.zeros(n, device=device), 3)
    return {"latency_s": latency, "s_per_byte": max(0.0, full - latency) / (4 * n)}
