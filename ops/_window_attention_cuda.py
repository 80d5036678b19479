"""Window attention's CUDA side: which kernel pair runs, grid sizing, the launchers.

Two kernel pairs in ``kernels/window_attention.cu``: ``mma`` (tensor-core ``mma.sync``, sm_80+)
and ``scalar`` (fp32 FMAs in shared memory, any GPU; the verified fallback).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from aiak.ops import _cuda
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._driver import Kernel
from aiak.ops._window_attention_ref import (
    HALF,
    HEAD_DIMS,
    MAX_TOKENS,
    _attention_backward_reference,
    _attention_reference,
    _check_attention,
    _shape_reasons,
)

ATTN = declare(
    Capability(
        "window_attention",
        dtypes=HALF,
        input_reasons=_shape_reasons,
        conditions=(f"N <= {MAX_TOKENS} tokens per window", f"head_dim in {HEAD_DIMS}"),
    )
)
SOURCE = "window_attention.cu"
_CODE = {torch.float16: "f16", torch.bfloat16: "bf16"}
_THREADS = 128  # WA_THREADS in the source
_SIZES = "i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, "
_SIZES += "i32 B_, i32 nH, i32 N, i32 nW, f32 scale"
_PARAMS = {
    "fwd": "ptr q, ptr k, ptr v, ptr bias, ptr mask, ptr out, " + _SIZES,
    "bwd": "ptr dout, ptr q, ptr k, ptr v, ptr bias, ptr mask, ptr dq, ptr dk, ptr dv, "
    "ptr dbias, " + _SIZES,
}
# (kind, dtype, head dim) -> the kernel; kind: "fwd", "bwd", "mma_fwd" or "mma_bwd"
_KERNELS = {
    (kind, dtype, d): Kernel(SOURCE, f"window_attention_{kind}_{code}_d{d}", _PARAMS[kind[-3:]])
    for kind in ("fwd", "bwd", "mma_fwd", "mma_bwd")
    for dtype, code in _CODE.items()
    for d in (32, 64)
}
_STATIC_SMEM = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory

# Which CUDA kernel pair runs window attention: "mma" (tensor-core mma.sync, sm_80+) or "scalar"
# (fp32 FMAs in shared memory, any GPU; the verified fallback). The environment variable
# overrides the default; devices below sm_80 always run "scalar". Read only by
# `attention_kernel`.
KERNEL_ENV = "AIAK_WINDOW_ATTENTION_KERNEL"
DEFAULT_KERNEL = "mma"
KERNEL_CHOICES = ("mma", "scalar")
_MMA_MIN_CC = (8, 0)


def attention_kernel(device: torch.device) -> str:
    """The CUDA kernel pair window attention uses on ``device``: ``"mma"`` or ``"scalar"``.

    ``AIAK_WINDOW_ATTENTION_KERNEL`` (``mma`` | ``scalar``) overrides :data:`DEFAULT_KERNEL`;
    a device below compute capability 8.0 (no m16n8k16 mma) runs ``"scalar"`` whatever is asked.
    """
    choice = os.environ.get(KERNEL_ENV, DEFAULT_KERNEL)
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV} must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "mma":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _cuda.device_capability(index) < _MMA_MIN_CC:
            return "scalar"
    return choice


def _use_attention_kernel(q: torch.Tensor) -> bool:
    return use_kernel(ATTN, q.device, (q.dtype,), (q,))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fp32_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def _smem_floats(n: int, d: int, backward: bool) -> int:
    np_ = (n + 3) & ~3
    ld, ls = d + 1, np_ + 1
    if backward:
        return 4 * np_ * ld + 2 * np_ * ls + n * n
    return 3 * np_ * ld + np_ * ls


def _mma_smem_bytes(d: int, backward: bool) -> int:
    """Dynamic shared memory of the mma kernels (WM_* in the source): the fp32 [64][72]
    bias + mask table, [64][D + 8] q/k/v (and dout) tiles, and in backward [64][72] P and dS."""
    table = 64 * 72 * 4
    tiles = (4 if backward else 3) * 64 * (d + 8) * 2
    return table + tiles + (2 * 64 * 72 * 2 if backward else 0)


def _kernel(kind: str, dtype: torch.dtype, d: int, smem: int) -> tuple[Kernel, Any]:
    """The kernel and its CuPy function, with the function attributes its launches need (set on
    the kernel's ``CUfunction``, so they hold for the kernel's launches)."""
    kernel = _KERNELS[kind, dtype, d]
    fn = kernel.function()
    if smem > _STATIC_SMEM and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    if kind.startswith("mma") and id(fn) not in _CARVED:
        # all of L1 as shared memory: the grid is sized for the blocks that fit by shared
        # memory (`_mma_blocks`), and these kernels read global memory once, through registers
        fn.preferred_shared_memory_carveout = 100
        _CARVED.add(id(fn))
    return kernel, fn


_CARVED: set[int] = set()


def _sm_limits(device: int) -> tuple[int, int]:
    """(shared memory bytes, 32-bit registers) of one SM of ``device``."""
    limits = _SM_LIMITS.get(device)
    if limits is None:
        props = _cuda.cupy().cuda.runtime.getDeviceProperties(device)
        limits = (int(props["sharedMemPerMultiprocessor"]), int(props["regsPerMultiprocessor"]))
        _SM_LIMITS[device] = limits
    return limits


_SM_LIMITS: dict[int, tuple[int, int]] = {}


@functools.cache
def _num_regs(fn: Any, device: int) -> int:
    return int(fn.num_regs)


def _mma_blocks(fn: Any, windows: int, heads: int, nw: int, smem: int) -> int:
    """Blocks per head G for the mma kernels: a multiple of nW (every window of a block then
    shares one mask, folded into the block's bias table once), as many as fit on the GPU at
    once (one wave: each block loops over windows G apart, so a second partial wave would
    double the time of its SMs)."""
    device = torch.cuda.current_device()
    smem_sm, regs_sm = _sm_limits(device)
    regs = max(1, -(-_num_regs(fn, device) // 8) * 8) * _THREADS
    per_sm = max(1, min(2048 // _THREADS, regs_sm // regs, smem_sm // (smem + 1024)))
    resident = per_sm * _cuda.num_sms(device)
    blocks = nw * max(1, resident // (heads * nw))
    return min(blocks, windows)


def _mma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` when the mma kernels' 16-byte row loads are aligned (pointer and the strides of
    the first three dims, the last dim contiguous), else a contiguous copy."""
    ok = (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(t.stride(i) % 8 == 0 for i in range(3))
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


# --------------------------------------------------------------------------------------------
# Launch plans: everything about a launch that the inputs' metadata decides, computed once
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One launch configuration: the kernel, grid, shared memory, the argument tail after
    the pointers (int64 strides, int32 sizes), and what a call with this metadata must still
    do per call (``align``: the q/k/v pointer bits that must be zero; bias/mask conversion to
    fp32)."""

    kernel: Kernel
    grid: tuple[int, int]
    smem: int
    tail: tuple
    device: int
    align: int
    bias_fp32: bool
    mask_fp32: bool


_PLANS: dict[tuple, _Plan] = {}


def _meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _plan_key(kernel: str, backward: bool, q, k, v, bias, mask) -> tuple:
    return (kernel, backward, _meta(q), _meta(k), _meta(v), _meta(bias), _meta(mask))


def _ready32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _make_plan(kernel: str, backward: bool, q, k, v, bias, mask) -> _Plan:
    """The plan for checked inputs that need no copy of q, k or v (``kernel`` usable)."""
    windows, heads, n, d = q.shape
    nw = mask.shape[0] if mask is not None else 1
    tail = (*_strides(q), *_strides(k), *_strides(v))
    tail += (windows, heads, n, nw)
    if kernel == "mma":
        smem = _mma_smem_bytes(d, backward)
        launcher, fn = _kernel("mma_bwd" if backward else "mma_fwd", q.dtype, d, smem)
        blocks = _mma_blocks(fn, windows, heads, nw, smem)
    else:
        smem = 4 * _smem_floats(n, d, backward)
        launcher, _ = _kernel("bwd" if backward else "fwd", q.dtype, d, smem)
        blocks = windows
        if backward:
            # Each block loops over windows of one head and adds its bias gradient once: about
            # eight blocks per SM in all keeps the atomics' contention at G-way, not B_-way.
            sms = _cuda.num_sms(torch.cuda.current_device())
            blocks = max(1, min(windows, (8 * sms) // heads))
    return _Plan(
        launcher,
        (blocks, heads),
        smem,
        tail,
        torch.cuda.current_device(),
        15 if kernel == "mma" else 0,
        _ready32(bias),
        _ready32(mask),
    )


def _prepared(kernel: str, backward: bool, q, k, v, bias, mask) -> tuple[_Plan, tuple]:
    """The plan and q, k, v for checked inputs on the kernel path (copies where the kernel
    cannot read a view; plans of copy-free metadata are cached)."""
    prep = _mma_ready if kernel == "mma" else _last_dim_contiguous
    ready = tuple(prep(t) for t in (q, k, v))
    key = _plan_key(kernel, backward, *ready, bias, mask)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(kernel, backward, *ready, bias, mask)
        if all(a is b for a, b in zip(ready, (q, k, v))):
            _PLANS[key] = plan
    return plan, ready


def _cached(kernel: str, dout, q, k, v, bias, mask, scale) -> _Plan | None:
    """The cached plan when this call can use it as is: the inputs' metadata was checked
    before (it is the key), the kernel is still enabled, same device, pointers aligned."""
    plan = _PLANS.get(_plan_key(kernel, dout is not None, q, k, v, bias, mask))
    if (
        plan is None
        or type(scale) is not float
        or (dout is not None and (dout.shape != q.shape or dout.dtype != q.dtype))
        or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & plan.align
        or plan.device != torch.cuda.current_device()
        or _cuda.kernels_disabled()
    ):
        return None
    return plan


def _launch(plan: _Plan, tensors: tuple, scale: float) -> None:
    plan.kernel(plan.grid, _THREADS, *tensors, *plan.tail, scale, shared_mem=plan.smem)


def _fp32(t: torch.Tensor | None, ready: bool) -> torch.Tensor | None:
    return t if ready else _fp32_contiguous(t)


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise ValueError(
            f"window_attention: kernel must be one of {KERNEL_CHOICES}, got {kernel!r}"
        )


def _attention_cuda_with(kernel, q, k, v, bias, mask, scale) -> torch.Tensor:
    """The forward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``)."""
    plan = _cached(kernel, None, q, k, v, bias, mask, scale)
    if plan is None:
        _check_attention(q, k, v, bias, mask, scale)
        _check_kernel(kernel)
        if not _use_attention_kernel(q):
            return _attention_reference(q, k, v, bias, mask, scale)
        if q.numel() == 0:
            return torch.empty(q.shape, dtype=q.dtype, device=q.device)
        with _cuda.on_device(q.device):
            plan, (q, k, v) = _prepared(kernel, False, q, k, v, bias, mask)
            return _forward(plan, q, k, v, bias, mask, scale)
    return _forward(plan, q, k, v, bias, mask, scale)


def _forward(plan: _Plan, q, k, v, bias, mask, scale) -> torch.Tensor:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bias32, mask32 = _fp32(bias, plan.bias_fp32), _fp32(mask, plan.mask_fp32)
    _launch(plan, (q, k, v, bias32, mask32, out), scale)
    return out


def _attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale) -> tuple:
    """The backward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``)."""
    plan = _cached(kernel, dout, q, k, v, bias, mask, scale)
    if plan is None:
        _check_attention(q, k, v, bias, mask, scale)
        _check_kernel(kernel)
        if dout.shape != q.shape:
            raise ValueError(
                f"window_attention: grad has shape {tuple(dout.shape)}, not {tuple(q.shape)}"
            )
        if not _use_attention_kernel(q):
            return _attention_backward_reference(dout, q, k, v, bias, mask, scale)
        if q.numel() == 0:
            grads = tuple(torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in "qkv")
            return (*grads, torch.zeros(bias.shape, dtype=bias.dtype, device=q.device))
        with _cuda.on_device(q.device):
            plan, (q, k, v) = _prepared(kernel, True, q, k, v, bias, mask)
            return _backward(plan, dout.to(q.dtype), q, k, v, bias, mask, scale)
    return _backward(plan, dout, q, k, v, bias, mask, scale)


def _backward(plan: _Plan, dout, q, k, v, bias, mask, scale) -> tuple:
    dout = dout.contiguous()  # autograd's grad of a transposed output is a strided view
    if dout.data_ptr() & plan.align:
        dout = dout.clone()
    dq, dk, dv = (torch.empty_like(q, memory_format=torch.contiguous_format) for _ in "qkv")
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=dq.device)
    bias32, mask32 = _fp32(bias, plan.bias_fp32), _fp32(mask, plan.mask_fp32)
    _launch(plan, (dout, q, k, v, bias32, mask32, dq, dk, dv, dbias), scale)
    return dq, dk, dv, dbias if bias.dtype == torch.float32 else dbias.to(bias.dtype)


def _attention_cuda(q, k, v, bias, mask, scale) -> torch.Tensor:
    kernel = attention_kernel(q.device) if q.is_cuda else DEFAULT_KERNEL
    return _attention_cuda_with(kernel, q, k, v, bias, mask, scale)


def _attention_backward_cuda(dout, q, k, v, bias, mask, scale) -> tuple:
    kernel = attention_kernel(q.device) if q.is_cuda else DEFAULT_KERNEL
    return _attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale)


def eager_on(device_type: str) -> Callable[[torch.Tensor], bool]:
    """The eager path's predicate for tensors of ``device_type`` (CPU stands in for CUDA in
    research/profile_window_attention_host.py)."""

    def eager(t: torch.Tensor) -> bool:
        return (
            type(t) in _PLAIN
            and t.device.type == device_type
            and not torch.compiler.is_compiling()
            and _current_dispatch_mode() is None
        )

    return eager


def eager(t: torch.Tensor) -> bool:
    """True when a call on ``t`` needs nothing of the dispatcher: a plain CUDA tensor, no
    ``torch.compile`` tracing, no ``TorchDispatchMode`` (fake tensors, functionalization).
    Then the public functions run their kernels under a ``torch.autograd.Function``."""
    return (
        type(t) in _PLAIN
        and t.is_cuda
        and not torch.compiler.is_compiling()
        and _current_dispatch_mode() is None
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)
