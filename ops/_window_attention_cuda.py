"""Window attention's CUDA side: which kernel pair runs, grid sizing, the launchers.

Two kernel pairs in ``kernels/window_attention.cu``: ``mma`` (tensor-core ``mma.sync``, sm_80+)
and ``scalar`` (fp32 FMAs in shared memory, any GPU; the verified fallback). The ``mma``
backward comes in compile-time variants (:data:`BWD_VARIANTS`), one chosen per process.
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
from aiak.ops._window_attention_kernels import (
    _KERNELS,
    _THREADS,
    BWD_VARIANTS,
    FWD_VARIANTS,
    _fp32_contiguous,
    _last_dim_contiguous,
    _mma_ready,
    _mma_smem_bytes,
    _out_strides,
    _out_views,
    _smem_floats,
    _strides,
    bwd_variant,
    fwd_variant,
)
from aiak.ops._window_attention_kernels import SOURCE as SOURCE  # window_partition's too
from aiak.ops._window_attention_ref import (
    HALF,
    HEAD_DIMS,
    MAX_TOKENS,
    _attention_backward_reference,
    _attention_reference,
    _check_attention,
    _check_grad,
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


# --------------------------------------------------------------------------------------------
# Launch plans: everything about a launch that the inputs' metadata decides, computed once
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One launch configuration: the kernel, grid, shared memory, the argument tail after
    the pointers (int64 strides, int32 sizes), and what a call with this metadata must still
    do per call (``align``: the q/k/v (and dout) pointer bits that must be zero; bias/mask
    conversion to fp32)."""

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


def _plan_key(kernel: str, backward: bool, q, k, v, bias, mask, x=None) -> tuple:
    """``x``: (the mma variant, the forward's ``tokens_first``), or in backward (the variant,
    dout, the strides of dq/dk/dv when given as views, else None)."""
    extra = None if x is None else (x[0], _meta(x[1]), x[2]) if backward else x
    return (kernel, backward, extra, _meta(q), _meta(k), _meta(v), _meta(bias), _meta(mask))


def _ready32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _make_plan(kernel: str, backward: bool, q, k, v, bias, mask, x) -> _Plan:
    """The plan for checked inputs that need no copy (``kernel`` usable); ``x`` as in
    :func:`_plan_key`."""
    windows, heads, n, d = q.shape
    nw = mask.shape[0] if mask is not None else 1
    tail = (*_strides(q), *_strides(k), *_strides(v))
    tail += (*_strides(x[1]), *(x[2] or _out_strides(q, False))) if backward else ()
    tail += () if backward else _out_strides(q, x[1])
    tail += (windows, heads, n, nw)
    if kernel == "mma":
        variant = BWD_VARIANTS[x[0]] if backward else None
        smem = _mma_smem_bytes(d, backward, variant is not None and variant.alias_ps)
        launcher, fn = _kernel(f"mma_{'bwd' if backward else 'fwd'}_{x[0]}", q.dtype, d, smem)
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


def _prepared(kernel: str, backward: bool, q, k, v, bias, mask, x) -> tuple[_Plan, tuple, Any]:
    """The plan, q, k, v and ``x`` (dout ready for the kernel in backward) for checked inputs on
    the kernel path (copies where the kernel cannot read a view; plans of copy-free metadata
    are cached)."""
    prep = _mma_ready if kernel == "mma" else _last_dim_contiguous
    given = (q, k, v, x[1]) if backward else (q, k, v)
    ready = tuple(prep(t) for t in given)
    x = (x[0], ready[3], x[2]) if backward else x
    key = _plan_key(kernel, backward, *ready[:3], bias, mask, x)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(kernel, backward, *ready[:3], bias, mask, x)
        if all(a is b for a, b in zip(ready, given)):
            _PLANS[key] = plan
    return plan, ready[:3], x


def _cached(kernel: str, backward: bool, q, k, v, bias, mask, scale, x) -> _Plan | None:
    """The cached plan when this call can use it as is: the inputs' metadata was checked
    before (it is the key), the kernel is still enabled, same device, pointers aligned."""
    if backward and not isinstance(x[1], torch.Tensor):
        return None
    plan = _PLANS.get(_plan_key(kernel, backward, q, k, v, bias, mask, x))
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | (x[1].data_ptr() if backward else 0)
    if (
        plan is None
        or type(scale) is not float
        or ptrs & plan.align
        or plan.device != torch.cuda.current_device()
        or _cuda.kernels_disabled()
    ):
        return None
    return plan


def _launch(plan: _Plan, tensors: tuple, scale: float) -> None:
    plan.kernel(plan.grid, _THREADS, *tensors, *plan.tail, scale, shared_mem=plan.smem)


def _fp32(t: torch.Tensor | None, ready: bool) -> torch.Tensor | None:
    return t if ready else _fp32_contiguous(t)


def _check_variant(variant: str, variants: dict) -> None:
    if variant not in variants:
        raise ValueError(
            f"window_attention: variant must be one of {tuple(variants)}, got {variant!r}"
        )


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise ValueError(
            f"window_attention: kernel must be one of {KERNEL_CHOICES}, got {kernel!r}"
        )


def _attention_cuda_with(
    kernel, q, k, v, bias, mask, scale, tokens_first: bool = False, variant: str | None = None
) -> torch.Tensor:
    """The forward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``); ``variant``:
    the mma forward's (default :func:`fwd_variant`)."""
    variant = fwd_variant() if variant is None else variant
    plan = _cached(kernel, False, q, k, v, bias, mask, scale, (variant, tokens_first))
    if plan is None:
        _check_attention(q, k, v, bias, mask, scale)
        _check_kernel(kernel)
        _check_variant(variant, FWD_VARIANTS)
        if not _use_attention_kernel(q):
            return _attention_reference(q, k, v, bias, mask, scale, tokens_first)
        if q.numel() == 0:
            return _empty_out(q, tokens_first)
        with _cuda.on_device(q.device):
            x = (variant, tokens_first)
            plan, (q, k, v), _ = _prepared(kernel, False, q, k, v, bias, mask, x)
            return _forward(plan, q, k, v, bias, mask, scale, tokens_first)
    return _forward(plan, q, k, v, bias, mask, scale, tokens_first)


def _empty_out(q: torch.Tensor, tokens_first: bool) -> torch.Tensor:
    windows, heads, n, d = q.shape
    shape = (windows, n, heads, d) if tokens_first else (windows, heads, n, d)
    return torch.empty(shape, dtype=q.dtype, device=q.device)


def _forward(plan: _Plan, q, k, v, bias, mask, scale, tokens_first) -> torch.Tensor:
    out = _empty_out(q, tokens_first)
    bias32, mask32 = _fp32(bias, plan.bias_fp32), _fp32(mask, plan.mask_fp32)
    _launch(plan, (q, k, v, bias32, mask32, out), scale)
    return out


def _attention_backward_cuda_with(
    kernel, dout, q, k, v, bias, mask, scale, variant: str | None = None, out: tuple = ()
) -> tuple:
    """The backward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``); ``variant``:
    the mma backward's (default :func:`bwd_variant`). ``dout`` may be any [B_, nH, N, D] view
    with a contiguous last dim (autograd's grad of a ``tokens_first`` output, transposed).
    ``out``: dq, dk, dv to write, views with one set of strides (e.g. slices of the gradient of
    a packed qkv tensor), else they are allocated."""
    variant = bwd_variant() if variant is None else variant
    views = _out_views(out, q)
    plan = _cached(kernel, True, q, k, v, bias, mask, scale, (variant, dout, views))
    if plan is None:
        _check_attention(q, k, v, bias, mask, scale)
        _check_kernel(kernel)
        _check_variant(variant, BWD_VARIANTS)
        _check_grad(dout, q)
        if not _use_attention_kernel(q) or q.numel() == 0:
            grads = _attention_backward_reference(dout, q, k, v, bias, mask, scale)
            for dst, src in zip(out, grads):
                dst.copy_(src)
            return (*out, grads[3]) if out else grads
        with _cuda.on_device(q.device):
            x = (variant, dout.to(q.dtype), views)
            plan, (q, k, v), (_, dout, _) = _prepared(kernel, True, q, k, v, bias, mask, x)
            return _backward(plan, dout, q, k, v, bias, mask, scale, out)
    return _backward(plan, dout, q, k, v, bias, mask, scale, out)


def _backward(plan: _Plan, dout, q, k, v, bias, mask, scale, out: tuple = ()) -> tuple:
    empty = (torch.empty_like(q, memory_format=torch.contiguous_format) for _ in "qkv")
    dq, dk, dv = out or empty
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=dq.device)
    bias32, mask32 = _fp32(bias, plan.bias_fp32), _fp32(mask, plan.mask_fp32)
    _launch(plan, (dout, q, k, v, bias32, mask32, dq, dk, dv, dbias), scale)
    return dq, dk, dv, dbias if bias.dtype == torch.float32 else dbias.to(bias.dtype)


def _attention_cuda(q, k, v, bias, mask, scale, tokens_first: bool = False) -> torch.Tensor:
    kernel = attention_kernel(q.device) if q.is_cuda else DEFAULT_KERNEL
    return _attention_cuda_with(kernel, q, k, v, bias, mask, scale, tokens_first)


def _attention_backward_cuda(dout, q, k, v, bias, mask, scale, out: tuple = ()) -> tuple:
    kernel = attention_kernel(q.device) if q.is_cuda else DEFAULT_KERNEL
    return _attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale, None, out)


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
