"""``aiak::cast_scale_``: ``dst = src * scale`` converted to ``dst``'s dtype, in one pass.

The product is computed in fp32 and rounded once to ``dst``'s dtype, so ``scale`` can lift
small fp32 values above fp16's underflow before the cast (Perseus's gradient scale) and a
``1/scale`` on the way back does not round the narrow value twice. aiak.comm's fp16/bf16
compression uses it for both directions of every bucket: one launch each way, no tables, no
host synchronisation. torch has no single op for it: ``torch.mul(half, fp32_tensor, out=f32)``
computes in fp32 but takes TensorIterator's broadcasting path, a fraction of copy bandwidth
(research/comm_nccl_notes.md).

Read top-down: checks, the PyTorch reference (the default kernel on every device), the CUDA
launcher, the op declaration.
"""

from __future__ import annotations

import ctypes

import torch

from aiak.ops import _cuda
from aiak.ops._capability import FLOAT_DTYPES, Capability, declare, use_kernel
from aiak.ops._driver import Kernel
from aiak.ops._registry import _increment, define

__all__ = ["cast_scale_"]

CAP = declare(Capability("cast_scale_"))
_SOURCE = "cast_scale.cu"
_CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_PARAMS = "ptr src, ptr dst, f32 scale, i64 n"
_KERNELS = {
    (s, d): Kernel(_SOURCE, f"cast_scale_{_CODE[s]}_{_CODE[d]}", _PARAMS)
    for s in _CODE
    for d in _CODE
}
_BLOCK = 512  # __launch_bounds__(512) in the source
_PER_THREAD = 8  # elements per thread and grid step


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _check(dst: torch.Tensor, src: torch.Tensor, scale: float, memory: bool = True) -> None:
    """``memory=False`` for fake tensors, which have no addresses to compare. The usual case
    is one expression; only a failure walks the arguments to name the culprit."""
    if not (
        type(dst) in _PLAIN
        and type(src) in _PLAIN
        and dst.dtype in _CODE
        and src.dtype in _CODE
        and dst.is_contiguous()
        and src.is_contiguous()
        and (
            src.is_cuda and src.get_device() == dst.get_device()
            if dst.is_cuda
            else src.device == dst.device
        )
        and src.numel() == dst.numel()
    ):
        _explain(dst, src)
    if not memory:
        return
    n = src.numel()
    a, b = src.data_ptr(), dst.data_ptr()
    in_place = a == b and src.dtype == dst.dtype
    if n and not in_place and a < b + n * dst.element_size() and b < a + n * src.element_size():
        raise ValueError(
            "cast_scale_: src and dst overlap in memory; only the very same tensor (same dtype) "
            "may be both"
        )


def _explain(dst: torch.Tensor, src: torch.Tensor) -> None:
    op = "cast_scale_"
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _CODE:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
            raise TypeError(f"{op}: {name} has dtype {t.dtype}, expected one of ({allowed})")
        if t.layout != torch.strided:
            raise TypeError(f"{op}: {name} has layout {t.layout}; only dense tensors")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous; call .contiguous() first")
    if src.device != dst.device:
        raise ValueError(f"{op}: src is on {src.device} but dst is on {dst.device}")
    if dst.numel() != src.numel():
        raise ValueError(
            f"{op}: dst has {dst.numel()} elements (shape {tuple(dst.shape)}) but src has "
            f"{src.numel()} (shape {tuple(src.shape)})"
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
    dev = dst.get_device()
    record = _records.get((src.dtype, dst.dtype, dev))
    if record is None or _cuda.kernels_disabled():
        if not use_kernel(CAP, dst.device, (src.dtype, dst.dtype)):  # warns once, says why
            _reference(dst, src, scale)
            return
        record = _launch_record(src.dtype, dst.dtype, dev)
    if n == 0:
        return
    kernel, max_blocks = record
    if not abs(scale) <= _F32_MAX:  # the kernel's fp32 scale: a huge one is inf, as in numpy
        scale = ctypes.c_float(scale).value
    # A grid-stride loop: 4 blocks of 512 per SM fill an SM that holds 2048 threads.
    blocks = min(-(-n // (_BLOCK * _PER_THREAD)), max_blocks)
    if dev == _cuda.device_index():
        kernel(blocks, _BLOCK, src.data_ptr(), dst.data_ptr(), scale, n)
    else:
        with torch.cuda.device(dev):
            kernel(blocks, _BLOCK, src.data_ptr(), dst.data_ptr(), scale, n)


# (src dtype, dst dtype, device index) -> (kernel, most blocks): what a launch needs besides
# the tensors, looked up once, for pairs the kernel supports. Host time decides this op's
# design: a bucket's cast is a few µs of GPU work, about what one launch costs the host.
_records: dict[tuple[torch.dtype, torch.dtype, int], tuple[Kernel, int]] = {}
_F32_MAX = 3.4028234663852886e38


def _launch_record(src: torch.dtype, dst: torch.dtype, dev: int) -> tuple[Kernel, int]:
    key = (src, dst, dev)
    found = _records.get(key)
    if found is None:
        found = _records[key] = (_KERNELS[src, dst], 4 * _cuda.num_sms(dev))
    return found


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
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"cast_scale_: scale must be a number, got {type(scale).__name__}")
        scale = float(scale)
    kernel = CAST_OP.eager_kernel((dst, src))
    if kernel is None:
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            _explain(dst, src)  # before the dispatcher's own TypeError
        CAST_OP.overload(dst, src, scale)
        return dst
    kernel(dst, src, scale)  # the Op's eager fast path, one call frame fewer; it checks src
    _increment((dst,))
    return dst
