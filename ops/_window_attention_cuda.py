"""Window attention's CUDA side: which kernel pair runs, grid sizing, the launchers.

Two kernel pairs in ``kernels/window_attention.cu``: ``mma`` (tensor-core ``mma.sync``, sm_80+)
and ``scalar`` (fp32 FMAs in shared memory, any GPU; the verified fallback).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any

import torch

from aiak.ops import _cuda
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._window_attention_ref import (
    HALF,
    _attention_backward_reference,
    _attention_reference,
    _check_attention,
    _shape_reasons,
)

ATTN = declare(Capability("window_attention", dtypes=HALF))
SOURCE = "window_attention.cu"
_CODE = {torch.float16: "f16", torch.bfloat16: "bf16"}
_THREADS = 128  # WA_THREADS in the source
_STATIC_SMEM = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory

# Which CUDA kernel pair runs window attention: "mma" (tensor-core mma.sync, sm_80+) or "scalar"
# (fp32 FMAs in shared memory, any GPU; the verified fallback). The environment variable
# overrides the default; devices below sm_80 always run "scalar". Read only by
# `attention_kernel`.
KERNEL_ENV = "AIAK_WINDOW_ATTENTION_KERNEL"
DEFAULT_KERNEL = "mma"
KERNEL_CHOICES = ("mma", "scalar")
_MMA_MIN_CC = (8, 0)

_shape_warned: set[str] = set()
_shape_lock = threading.Lock()


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
    if not use_kernel(ATTN, q.device, (q.dtype,)):
        return False
    reasons = _shape_reasons(q)
    if not reasons:
        return True
    key = "; ".join(reasons)
    with _shape_lock:
        first = key not in _shape_warned
        _shape_warned.add(key)
    if first:
        warnings.warn("falling back to the PyTorch reference: " + key, RuntimeWarning, stacklevel=3)
    return False


def _i64(value: int) -> Any:
    import numpy as np

    return np.int64(value)


def _f32(value: float) -> Any:
    import numpy as np

    return np.float32(value)


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


def _kernel(kind: str, dtype: torch.dtype, d: int, smem: int) -> Any:
    fn = _cuda.get_function(SOURCE, f"window_attention_{kind}_{_CODE[dtype]}_d{d}")
    if smem > _STATIC_SMEM and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    if kind.startswith("mma") and id(fn) not in _CARVED:
        # all of L1 as shared memory: the grid is sized for the blocks that fit by shared
        # memory (`_mma_blocks`), and these kernels read global memory once, through registers
        fn.preferred_shared_memory_carveout = 100
        _CARVED.add(id(fn))
    return fn


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


def _strides(t: torch.Tensor) -> tuple[Any, Any, Any]:
    return _i64(t.stride(0)), _i64(t.stride(1)), _i64(t.stride(2))


def _attention_cuda_with(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The forward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``)."""
    _check_attention(q, k, v, bias, mask, scale)
    if kernel not in KERNEL_CHOICES:
        raise ValueError(
            f"window_attention: kernel must be one of {KERNEL_CHOICES}, got {kernel!r}"
        )
    if not _use_attention_kernel(q):
        return _attention_reference(q, k, v, bias, mask, scale)
    windows, heads, n, d = q.shape
    out = torch.empty((windows, heads, n, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    prep = _mma_ready if kernel == "mma" else _last_dim_contiguous
    q, k, v = (prep(t) for t in (q, k, v))
    bias32, mask32 = _fp32_contiguous(bias), _fp32_contiguous(mask)
    nw = mask.shape[0] if mask is not None else 1
    with _cuda.on_device(q.device):
        args = (
            *(_cuda.ptr(t) for t in (q, k, v, bias32, mask32, out)),
            *_strides(q),
            *_strides(k),
            *_strides(v),
            _cuda.i32(windows),
            _cuda.i32(heads),
            _cuda.i32(n),
            _cuda.i32(nw),
            _f32(scale),
        )
        if kernel == "mma":
            smem = _mma_smem_bytes(d, backward=False)
            fn = _kernel("mma_fwd", q.dtype, d, smem)
            grid = (_mma_blocks(fn, windows, heads, nw, smem), heads)
        else:
            smem = 4 * _smem_floats(n, d, backward=False)
            fn = _kernel("fwd", q.dtype, d, smem)
            grid = (windows, heads)
        _cuda.launch(fn, grid, _THREADS, args, shared_mem=smem)
    return out


def _attention_backward_cuda_with(
    kernel: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward on CUDA with the ``kernel`` pair (``"mma"`` or ``"scalar"``)."""
    _check_attention(q, k, v, bias, mask, scale)
    if kernel not in KERNEL_CHOICES:
        raise ValueError(
            f"window_attention: kernel must be one of {KERNEL_CHOICES}, got {kernel!r}"
        )
    if dout.shape != q.shape:
        raise ValueError(f"window_attention: grad has shape {tuple(dout.shape)}, not {q.shape}")
    if not _use_attention_kernel(q):
        return _attention_backward_reference(dout, q, k, v, bias, mask, scale)
    windows, heads, n, d = q.shape
    dq, dk, dv = (
        torch.empty((windows, heads, n, d), dtype=q.dtype, device=q.device) for _ in "qkv"
    )
    dbias = torch.zeros((heads, n, n), dtype=torch.float32, device=q.device)
    if dq.numel() == 0:
        return dq, dk, dv, dbias.to(bias.dtype)
    dout = dout.to(q.dtype).contiguous()
    if kernel == "mma":
        dout = _mma_ready(dout)
        q, k, v = (_mma_ready(t) for t in (q, k, v))
    else:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    bias32, mask32 = _fp32_contiguous(bias), _fp32_contiguous(mask)
    nw = mask.shape[0] if mask is not None else 1
    with _cuda.on_device(q.device):
        args = (
            *(_cuda.ptr(t) for t in (dout, q, k, v, bias32, mask32, dq, dk, dv, dbias)),
            *_strides(q),
            *_strides(k),
            *_strides(v),
            _cuda.i32(windows),
            _cuda.i32(heads),
            _cuda.i32(n),
            _cuda.i32(nw),
            _f32(scale),
        )
        if kernel == "mma":
            smem = _mma_smem_bytes(d, backward=True)
            fn = _kernel("mma_bwd", q.dtype, d, smem)
            blocks = _mma_blocks(fn, windows, heads, nw, smem)
        else:
            smem = 4 * _smem_floats(n, d, backward=True)
            fn = _kernel("bwd", q.dtype, d, smem)
            # Each block loops over windows of one head and adds its bias gradient once: about
            # eight blocks per SM in all keeps the atomics' contention at G-way, not B_-way.
            sms = _cuda.num_sms(torch.cuda.current_device())
            blocks = max(1, min(windows, (8 * sms) // heads))
        _cuda.launch(fn, (blocks, heads), _THREADS, args, shared_mem=smem)
    return dq, dk, dv, dbias.to(bias.dtype)


def _attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    kernel = attention_kernel(q.device) if q.device.type == "cuda" else DEFAULT_KERNEL
    return _attention_cuda_with(kernel, q, k, v, bias, mask, scale)


def _attention_backward_cuda(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = attention_kernel(q.device) if q.device.type == "cuda" else DEFAULT_KERNEL
    return _attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale)
