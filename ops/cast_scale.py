"""``aiak::cast_scale_``: ``dst = src * scale`` converted to ``dst``'s dtype, in one pass.

The product is computed in fp32 and rounded once to ``dst``'s dtype, so ``scale`` can lift
small fp32 values above fp16's underflow before the cast (Perseus's gradient scale) and a
``1/scale`` on the way back does not round the narrow value twice. aiak.comm's fp16/bf16
compression uses it for both directions of every bucket: one launch each way, no tables, no
host synchronisation. torch has no single op for it: ``torch.mul(half, fp32_tensor, out=f32)``
computes in fp32 but takes TensorIterator's broadcasting path (measured ~33% of copy bandwidth
on 2 x H200 for a 64 MB bucket, benchmarks/results/comm_nccl_notes.md).

Read top-down: checks, the PyTorch reference (the default kernel on every device), the CUDA
launcher, the op declaration.
"""

from __future__ import annotations

import torch

from aiak.ops import _cuda
from aiak.ops._capability import FLOAT_DTYPES, Capability, declare, use_kernel
from aiak.ops._registry import define

__all__ = ["cast_scale_"]

CAP = declare(Capability("cast_scale_"))
_SOURCE = "cast_scale.cu"
_CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_BLOCK = 512  # __launch_bounds__(512) in the source
_PER_THREAD = 8  # elements per thread and grid step


def _check(dst: torch.Tensor, src: torch.Tensor, scale: float, memory: bool = True) -> None:
    """``memory=False`` for fake tensors, which have no addresses to compare."""
    op = "cast_scale_"
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _CODE:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
            raise TypeError(f"{op}: {name} has dtype {t.dtype}, expected one of ({allowed})")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous; call .contiguous() first")
    if src.device != dst.device:
        raise ValueError(f"{op}: src is on {src.device} but dst is on {dst.device}")
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(
            f"{op}: dst has {dst.numel()} elements (shape {tuple(dst.shape)}) but src has {n} "
            f"(shape {tuple(src.shape)})"
        )
    if not memory:
        return
    a, b = src.data_ptr(), dst.data_ptr()
    in_place = a == b and src.dtype == dst.dtype
    if n and not in_place and a < b + n * dst.element_size() and b < a + n * src.element_size():
        raise ValueError(
            f"{op}: src and dst overlap in memory; only the very same tensor (same dtype) may "
            "be both"
        )


def _reference(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    _check(dst, src, scale)
    if dst.numel() == 0:
        return
    # fp32 product (a Python scalar on an fp32 tensor computes in fp32), rounded once by copy_
    dst.copy_(torch.mul(src.float(), scale).view(dst.shape))


def _cast_cuda(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    _check(dst, src, scale)
    n = dst.numel()
    if not use_kernel(CAP, dst.device, (src.dtype, dst.dtype)):
        _reference(dst, src, scale)
        return
    if n == 0:
        return
    import numpy as np  # only on the CUDA path: `import aiak.ops` stays free of numpy

    with _cuda.on_device(dst.device):
        fn = _cuda.get_function(_SOURCE, f"cast_scale_{_CODE[src.dtype]}_{_CODE[dst.dtype]}")
        # A grid-stride loop: 4 blocks of 512 per SM fill an H100/H200 SM (2048 threads).
        steps = -(-n // (_BLOCK * _PER_THREAD))
        blocks = max(1, min(steps, 4 * _cuda.num_sms(torch.cuda.current_device())))
        _cuda.launch(
            fn, blocks, _BLOCK, (_cuda.ptr(src), _cuda.ptr(dst), np.float32(scale), np.int64(n))
        )


def _fake(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    _check(dst, src, scale, memory=False)


CAST_OP = define(
    "cast_scale_(Tensor(a!) dst, Tensor src, float scale) -> ()",
    _reference,
    cuda=_cast_cuda,
    fake=_fake,
)


def cast_scale_(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``dst = src * scale`` in fp32, rounded once to ``dst``'s dtype; returns ``dst``.

    fp32/fp16/bf16 in any pairing, contiguous, same element count (shapes may differ), same
    device; ``dst`` may be ``src`` itself. Never synchronises the host.
    """
    for name, t in (("dst", dst), ("src", src)):  # before the dispatcher's own TypeError
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cast_scale_: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"cast_scale_: scale must be a number, got {type(scale).__name__}")
    CAST_OP(dst, src, float(scale))
    return dst
