"""Swin window attention in one kernel per direction, and Swin's roll + window partition.

``aiak::window_attention(q, k, v, bias, mask, scale)``: for q/k/v ``[B_, nH, N, D]`` (``B_`` =
batch x windows per image), ``bias`` ``[nH, N, N]`` (the relative position bias, already
gathered from its table) and an optional ``mask`` ``[nW, N, N]`` applied to window
``b % nW`` (Swin's shifted-window mask)::

    out = softmax(scale * q @ k^T + bias + mask) @ v

Stock PyTorch (timm's default path) runs this as ten kernels writing the ``[B_, nH, N, N]``
scores to memory several times over; the kernel here keeps scores, softmax and both products
in shared memory, and the backward kernel recomputes the probabilities from q, k, v instead of
storing them. Gradients flow to q, k, v and bias (summed over windows and batch); the mask is a
constant (timm keeps it in a buffer). The CUDA kernel covers fp16/bf16 with N <= 64 and
D in {32, 64}; anything else runs the reference (fp32 arithmetic for half inputs) after a
one-time warning.

``aiak::roll_window_partition(x, window, shift)`` / ``aiak::window_merge_roll(windows, H, W,
shift)``: ``torch.roll(x, (-shift, -shift), (1, 2))`` followed by the window partition, and its
inverse, each one gather kernel (each is the other's gradient).

Read top-down: checks, references, CUDA launchers, op declarations, public functions.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from typing import Any

import torch

from aiak.ops import _cuda
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._registry import define

__all__ = ["roll_window_partition", "window_attention", "window_merge_roll"]

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_TOKENS = 64
HEAD_DIMS = (32, 64)
ATTN = declare(Capability("window_attention", dtypes=HALF))
PARTITION = declare(Capability("roll_window_partition", dtypes=FLOATS))
_SOURCE = "window_attention.cu"
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


# --------------------------------------------------------------------------------------------
# Checks (shared by the reference, the kernel and the fake, so every path rejects the same)
# --------------------------------------------------------------------------------------------


def _check_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> None:
    op = "window_attention"
    named = [("q", q), ("k", k), ("v", v), ("bias", bias)]
    if mask is not None:
        named.append(("mask", mask))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected a floating dtype")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B*nW, nH, N, D], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but q has {q.dtype}")
    windows, heads, n, _ = q.shape
    if tuple(bias.shape) != (heads, n, n):
        raise ValueError(
            f"{op}: bias must be [nH, N, N] = {(heads, n, n)}, got {tuple(bias.shape)}"
        )
    if mask is not None:
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (n, n) or mask.shape[0] == 0:
            raise ValueError(f"{op}: mask must be [nW, N, N] with N = {n}, got {tuple(mask.shape)}")
        if windows % mask.shape[0] != 0:
            raise ValueError(
                f"{op}: mask has {mask.shape[0]} windows, which does not divide q's "
                f"B*nW = {windows}"
            )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a number, got {type(scale).__name__}")


def _shape_reasons(q: torch.Tensor) -> list[str]:
    n, d = q.shape[-2], q.shape[-1]
    reasons = []
    if n > MAX_TOKENS:
        reasons.append(f"window_attention: N = {n} tokens per window > {MAX_TOKENS}")
    if d not in HEAD_DIMS:
        reasons.append(f"window_attention: head_dim {d} not in {HEAD_DIMS}")
    return reasons


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


# --------------------------------------------------------------------------------------------
# References: plain PyTorch, fp32 arithmetic for half inputs (float64 stays float64)
# --------------------------------------------------------------------------------------------


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    ct = _compute_dtype(q)
    windows, heads, n, _ = q.shape
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-2, -1)) * scale + bias.to(ct)
    if mask is not None:
        nw = mask.shape[0]
        s = (s.view(windows // nw, nw, heads, n, n) + mask.to(ct)[None, :, None]).view(s.shape)
    return torch.softmax(s, dim=-1)


def _attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    _check_attention(q, k, v, bias, mask, scale)
    p = _probabilities(q, k, bias, mask, scale)
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype)


def _attention_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_attention(q, k, v, bias, mask, scale)
    p = _probabilities(q, k, bias, mask, scale)
    ct = p.dtype
    do = dout.to(ct)
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.to(ct).transpose(-2, -1))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(ct)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(ct)) * scale
    dbias = ds.sum(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias.to(bias.dtype)


def _window_size(windows: torch.Tensor) -> int:
    area = windows.shape[1]
    ws = math.isqrt(area)
    if ws * ws != area or ws == 0:
        raise ValueError(
            f"window_merge_roll: windows must be [B*nW, ws*ws, C]; {area} tokens is not a square"
        )
    return ws


def _check_partition(x: torch.Tensor, window: int, shift: int) -> None:
    op = "roll_window_partition"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be [B, H, W, C], got shape {tuple(x.shape)}")
    _check_geometry(op, x.shape[1], x.shape[2], window, shift)


def _check_geometry(op: str, h: int, w: int, window: int, shift: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"{op}: window must be a positive int, got {window!r}")
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"{op}: shift must be a non-negative int, got {shift!r}")
    if h % window or w % window:
        raise ValueError(f"{op}: H = {h} and W = {w} must be multiples of window = {window}")


def _check_merge(windows: torch.Tensor, h: int, w: int, shift: int) -> int:
    op = "window_merge_roll"
    if not isinstance(windows, torch.Tensor):
        raise TypeError(f"{op}: windows must be a Tensor, got {type(windows).__name__}")
    if windows.dim() != 3:
        raise ValueError(f"{op}: windows must be [B*nW, ws*ws, C], got {tuple(windows.shape)}")
    ws = _window_size(windows)
    _check_geometry(op, h, w, ws, shift)
    per_image = (h // ws) * (w // ws)
    if windows.shape[0] % per_image:
        raise ValueError(
            f"{op}: windows has {windows.shape[0]} windows, not a multiple of the "
            f"{per_image} windows of an {h}x{w} image"
        )
    return ws


def _partition_reference(x: torch.Tensor, window: int, shift: int) -> torch.Tensor:
    _check_partition(x, window, shift)
    b, h, w, c = x.shape
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    x = x.reshape(b, h // window, window, w // window, window, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, c).clone()


def _merge_reference(windows: torch.Tensor, h: int, w: int, shift: int) -> torch.Tensor:
    ws = _check_merge(windows, h, w, shift)
    c = windows.shape[2]
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.reshape(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, h, w, c)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x.clone()


# --------------------------------------------------------------------------------------------
# CUDA launchers
# --------------------------------------------------------------------------------------------


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
    fn = _cuda.get_function(_SOURCE, f"window_attention_{kind}_{_CODE[dtype]}_d{d}")
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


def _gather_cuda(
    src: torch.Tensor, dst: torch.Tensor, h: int, w: int, ws: int, shift: int, merge: bool
) -> None:
    if dst.numel() == 0:
        return
    row = src.shape[-1] * src.element_size()  # bytes per token
    unit = next(
        u
        for u in (16, 8, 4, 2, 1)
        if row % u == 0 and src.data_ptr() % u == 0 and dst.data_ptr() % u == 0
    )
    units = row // unit
    total = dst.numel() * dst.element_size() // unit
    with _cuda.on_device(src.device):
        fn = _cuda.get_function(_SOURCE, f"window_gather_{unit}")
        blocks = max(1, min(-(-total // 256), 32 * _cuda.num_sms(torch.cuda.current_device())))
        args = (
            _cuda.ptr(src),
            _cuda.ptr(dst),
            _cuda.i32(h),
            _cuda.i32(w),
            _cuda.i32(ws),
            _cuda.i32(shift % h),
            _cuda.i32(shift % w),
            _i64(units),
            _i64(total),
            _cuda.i32(int(merge)),
        )
        _cuda.launch(fn, blocks, 256, args)


def _partition_cuda(x: torch.Tensor, window: int, shift: int) -> torch.Tensor:
    _check_partition(x, window, shift)
    if not use_kernel(PARTITION, x.device, (x.dtype,)):
        return _partition_reference(x, window, shift)
    b, h, w, c = x.shape
    x = x.contiguous()
    out = torch.empty(
        (b * (h // window) * (w // window), window * window, c), dtype=x.dtype, device=x.device
    )
    _gather_cuda(x, out, h, w, window, shift, merge=False)
    return out


def _merge_cuda(windows: torch.Tensor, h: int, w: int, shift: int) -> torch.Tensor:
    ws = _check_merge(windows, h, w, shift)
    if not use_kernel(PARTITION, windows.device, (windows.dtype,)):
        return _merge_reference(windows, h, w, shift)
    windows = windows.contiguous()
    c = windows.shape[2]
    b = windows.shape[0] // ((h // ws) * (w // ws))
    out = torch.empty((b, h, w, c), dtype=windows.dtype, device=windows.device)
    _gather_cuda(windows, out, h, w, ws, shift, merge=True)
    return out


# --------------------------------------------------------------------------------------------
# Fakes (shape and dtype for torch.compile)
# --------------------------------------------------------------------------------------------


def _attention_fake(q, k, v, bias, mask, scale):
    _check_attention(q, k, v, bias, mask, scale)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _attention_backward_fake(dout, q, k, v, bias, mask, scale):
    _check_attention(q, k, v, bias, mask, scale)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return (*grads, torch.empty_like(bias, memory_format=torch.contiguous_format))


def _partition_fake(x, window, shift):
    _check_partition(x, window, shift)
    b, h, w, c = x.shape
    return x.new_empty((b * (h // window) * (w // window), window * window, c))


def _merge_fake(windows, h, w, shift):
    ws = _check_merge(windows, h, w, shift)
    b = windows.shape[0] // ((h // ws) * (w // ws))
    return windows.new_empty((b, h, w, windows.shape[2]))


# --------------------------------------------------------------------------------------------
# Declarations and autograd
# --------------------------------------------------------------------------------------------

ATTENTION_OP = define(
    "window_attention(Tensor q, Tensor k, Tensor v, Tensor bias, Tensor? mask, float scale) "
    "-> Tensor",
    _attention_reference,
    cuda=_attention_cuda,
    fake=_attention_fake,
    differentiable=True,
)
ATTENTION_BACKWARD_OP = define(
    "window_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor bias, "
    "Tensor? mask, float scale) -> (Tensor, Tensor, Tensor, Tensor)",
    _attention_backward_reference,
    cuda=_attention_backward_cuda,
    fake=_attention_backward_fake,
)
PARTITION_OP = define(
    "roll_window_partition(Tensor x, int window, int shift) -> Tensor",
    _partition_reference,
    cuda=_partition_cuda,
    fake=_partition_fake,
    differentiable=True,
)
MERGE_OP = define(
    "window_merge_roll(Tensor windows, int H, int W, int shift) -> Tensor",
    _merge_reference,
    cuda=_merge_cuda,
    fake=_merge_fake,
    differentiable=True,
)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, bias, mask, scale = inputs
    ctx.save_for_backward(q, k, v, bias, mask)
    ctx.scale = scale


def _attention_backward(ctx, grad):
    q, k, v, bias, mask = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.aiak.window_attention_backward(
        grad, q, k, v, bias, mask, ctx.scale
    )
    return dq, dk, dv, dbias, None, None


def _partition_setup(ctx, inputs, output) -> None:
    x, _, shift = inputs
    ctx.hw = (x.shape[1], x.shape[2])
    ctx.shift = shift


def _partition_backward(ctx, grad):
    h, w = ctx.hw
    return torch.ops.aiak.window_merge_roll(grad.contiguous(), h, w, ctx.shift), None, None


def _merge_setup(ctx, inputs, output) -> None:
    windows, _, _, shift = inputs
    ctx.window = _window_size(windows)
    ctx.shift = shift


def _merge_backward(ctx, grad):
    x = torch.ops.aiak.roll_window_partition(grad.contiguous(), ctx.window, ctx.shift)
    return x, None, None, None


torch.library.register_autograd(
    "aiak::window_attention", _attention_backward, setup_context=_attention_setup
)
torch.library.register_autograd(
    "aiak::roll_window_partition", _partition_backward, setup_context=_partition_setup
)
torch.library.register_autograd(
    "aiak::window_merge_roll", _merge_backward, setup_context=_merge_setup
)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(scale * q @ k^T + bias + mask[b % nW]) @ v`` for Swin windows.

    q, k, v ``[B*nW, nH, N, D]`` of one dtype; ``bias`` ``[nH, N, N]`` and ``mask``
    ``[nW, N, N]`` of any float dtype (fp32 under autocast); ``scale`` defaults to
    ``D ** -0.5``. Differentiable in q, k, v and bias; the mask must not require grad.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):  # before the dispatcher's
        if not isinstance(t, torch.Tensor):  # own, unnamed error
            raise TypeError(f"window_attention: {name} must be a Tensor, got {type(t).__name__}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"window_attention: mask must be a Tensor or None, got {type(mask).__name__}"
        )
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        raise ValueError("window_attention: mask must not require grad (it is a constant)")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"window_attention: scale must be a number, got {type(scale).__name__}")
    return ATTENTION_OP(q, k, v, bias, mask, float(scale))


def roll_window_partition(x: torch.Tensor, window: int, shift: int = 0) -> torch.Tensor:
    """``[B, H, W, C]`` -> ``[B*nW, window*window, C]``: ``torch.roll`` by ``-shift`` on H and W,
    then Swin's window partition, in one gather."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"roll_window_partition: x must be a Tensor, got {type(x).__name__}")
    _check_geometry("roll_window_partition", 1, 1, 1, shift)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"roll_window_partition: window must be a positive int, got {window!r}")
    return PARTITION_OP(x, window, shift)


def window_merge_roll(windows: torch.Tensor, H: int, W: int, shift: int = 0) -> torch.Tensor:
    """The inverse of :func:`roll_window_partition`: windows back to ``[B, H, W, C]``, then
    ``torch.roll`` by ``+shift``."""
    if not isinstance(windows, torch.Tensor):
        raise TypeError(
            f"window_merge_roll: windows must be a Tensor, got {type(windows).__name__}"
        )
    _check_geometry("window_merge_roll", 1, 1, 1, shift)
    return MERGE_OP(windows, H, W, shift)
