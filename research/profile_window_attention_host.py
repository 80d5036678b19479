"""Host (CPU) µs per call of window attention's CUDA path, on the CPU with the launches stubbed.

    python research/profile_window_attention_host.py [--calls 200] [--profile]

Not a speed claim: a diagnosis of the Python around the kernel launches. A converted
swin_tiny training step is host-bound (the GPU waits on the host), so each call's host time is
what the step pays. Rows, each forward + backward, ours against the torch code it replaces
(interleaved runs, so both see the same machine load):

- attention: ``window_attention`` vs ``(q * scale) @ k^T + bias (+ mask) -> softmax -> @ v``;
- partition: ``roll_window_partition`` vs ``torch.roll`` + view/permute/reshape;
- merge: ``window_merge_roll`` vs view/permute/reshape + ``torch.roll``;
- bias: ``FusedWindowAttention.relative_position_bias()`` vs timm's gather
  (``table[index].view().permute().contiguous()``).

How the CUDA path runs here (:func:`stubbed`): CPU tensors take the CUDA branch (the eager
predicate, and the ops' CUDA functions registered for the CPU key, for the dispatcher path),
the kernels are reported usable, kernel functions are a stand-in object, and every launch runs
``_driver.Kernel`` in full but for the driver call itself. The torch rows run real CPU kernels
on one 49-token window (their compute is a few µs of the figure). Tensors are tiny: the host
cost is per call, not per byte.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from profile_optim_host import _no_launch, _Patch, _reasons_as_on_cuda, paired_us, top_functions

import aiak.ops  # noqa: F401
from aiak.ops import _capability, _cuda, _driver
from aiak.ops import _window_attention_cuda as wac
from aiak.ops.swin import FusedWindowAttention
from aiak.ops.window_attention import window_attention
from aiak.ops.window_partition import roll_window_partition, window_merge_roll


class _Function:
    """Stands in for a CuPy RawKernel: the attributes the launchers read and set."""

    kernel = type("Handle", (), {"ptr": 1})()  # the driver handle _driver.Kernel loads
    num_regs = 128
    max_dynamic_shared_size_bytes = 48 * 1024
    preferred_shared_memory_carveout = 0


_FN = _Function()
_CUDA_IMPLS = {
    "window_attention": "_attention_cuda",
    "window_attention_backward": "_attention_backward_cuda",
    "roll_window_partition": "_partition_cuda",
    "window_merge_roll": "_merge_cuda",
}


def _cuda_impls() -> dict[str, Callable[..., Any]]:
    import importlib

    wp = importlib.import_module("aiak.ops.window_partition")
    wa = importlib.import_module("aiak.ops.window_attention")
    return {op: getattr(wa, fn, None) or getattr(wp, fn) for op, fn in _CUDA_IMPLS.items()}


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """The CUDA path's Python on CPU tensors, every launch a no-op (see the module doc)."""
    mp = _Patch()
    mp.set(_capability.Capability, "not_supported_reasons", _reasons_as_on_cuda)
    mp.set(_cuda, "cupy_unavailable_reason", lambda: None)
    mp.set(_cuda, "device_capability", lambda device: (9, 0))
    mp.set(_driver, "_ex", _no_launch)
    for k in _driver.DECLARED:  # the stand-in handles never reach a real launch
        mp.set(k, "_handles", {})
    mp.set(_cuda, "device_index", lambda: 0)
    mp.set(_cuda, "get_function", lambda *a, **k: _FN)
    mp.set(_cuda, "num_sms", lambda device: 132)
    mp.set(torch.cuda, "current_device", lambda: 0)
    mp.set(_cuda, "raw_stream", lambda device: 0)
    mp.set(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    if hasattr(wac, "eager"):  # the eager path's predicate: CPU tensors count as CUDA ones
        mp.set(wac, "eager", wac.eager_on("cpu"))
    lib = torch.library.Library("aiak", "IMPL")
    for op, fn in _cuda_impls().items():  # the dispatcher path: CPU tensors run the CUDA impls
        lib.impl(op, fn, "CPU")
    try:
        yield
    finally:
        lib._destroy()
        mp.undo()


def _attention_rows(calls: int) -> list[tuple[str, float, float]]:
    heads, n, d = 1, 49, 32
    q, k, v = (torch.randn(1, heads, n, d).half().requires_grad_() for _ in "qkv")
    bias = torch.randn(heads, n, n, requires_grad=True)
    mask = torch.zeros(1, n, n)
    g = torch.randn(1, heads, n, d).half()
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    gf = g.float()

    def ours() -> None:
        window_attention(q, k, v, bias, mask, 0.17).backward(g)

    def torch_ops() -> None:
        attn = (qf * 0.17) @ kf.transpose(-2, -1) + bias.unsqueeze(0)
        attn = attn.view(1, 1, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        (attn.view(1, heads, n, n).softmax(-1) @ vf).backward(gf)

    with stubbed():
        a, b = paired_us(ours, torch_ops, calls)
    return [("attention fwd+bwd", a, b)]


def _partition_rows(calls: int) -> list[tuple[str, float, float]]:
    ws, shift = 7, 3
    x = torch.randn(1, 14, 14, 8, requires_grad=True)
    w = torch.randn(4, 49, 8, requires_grad=True)
    gx, gw = torch.randn(4, 49, 8), torch.randn(1, 14, 14, 8)

    def part_ours() -> None:
        roll_window_partition(x, ws, shift).backward(gx)

    def part_torch() -> None:
        y = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        y = y.view(1, 2, ws, 2, ws, 8).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws * ws, 8)
        y.backward(gx)

    def merge_ours() -> None:
        window_merge_roll(w, 14, 14, shift).backward(gw)

    def merge_torch() -> None:
        y = w.view(1, 2, 2, ws, ws, 8).permute(0, 1, 3, 2, 4, 5).reshape(1, 14, 14, 8)
        torch.roll(y, shifts=(shift, shift), dims=(1, 2)).backward(gw)

    with stubbed():
        rows = [("partition fwd+bwd", *paired_us(part_ours, part_torch, calls))]
        rows.append(("merge fwd+bwd", *paired_us(merge_ours, merge_torch, calls)))
    return rows


class _TimmAttention(nn.Module):
    def __init__(self, ws: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.scale, self.window_size = heads, 0.17, (ws, ws)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads))
        c = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
        c = c.flatten(1)
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1])
        self.qkv, self.proj = nn.Linear(8, 3 * 8), nn.Linear(8, 8)

    def bias(self) -> torch.Tensor:
        n = self.window_size[0] ** 2
        b = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return b.view(n, n, -1).permute(2, 0, 1).contiguous()


def _bias_rows(calls: int) -> list[tuple[str, float, float]]:
    timm = _TimmAttention(7, 3)
    fused = FusedWindowAttention(timm)
    g = torch.randn(3, 49, 49)
    a, b = paired_us(
        lambda: fused.relative_position_bias().backward(g),
        lambda: timm.bias().backward(g),
        calls,
    )
    return [("bias gather fwd+bwd", a, b)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = _attention_rows(args.calls) + _partition_rows(args.calls) + _bias_rows(args.calls)
    print(f"host µs per call (CPU time, launches stubbed), torch {torch.__version__}")
    print(f"{'what':22s} {'ours':>9s} {'torch ops':>10s} {'ours/torch':>11s}")
    for name, ours, ref in rows:
        print(f"{name:22s} {ours:9.1f} {ref:10.1f} {ours / ref:11.2f}")
    if args.profile:
        q, k, v = (torch.randn(1, 1, 49, 32).half().requires_grad_() for _ in "qkv")
        bias = torch.randn(1, 49, 49, requires_grad=True)
        with stubbed():
            print("\n== attention fwd+bwd, CUDA path (launch stubbed), cProfile top functions")
            print(top_functions(lambda: window_attention(q, k, v, bias).sum().backward(), 300))


if __name__ == "__main__":
    main()
