"""``aiak::multi_tensor_scale_``: ``dst[i] = src[i] * scale`` (fp32 product, rounded once to
``dst``'s dtype) over a whole list, flagging non-finite ``src`` values in ``found_inf``.

One CUDA launch (``kernels/multi_tensor_scale.cu``) over the lists' device table
(``ops/_mta.py``). Pairs match by element count, as in apex (a flat master may stand for a
shaped grad). Read top-down: checks, reference, CUDA launcher, the op, the Python convenience.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from aiak.ops import _cuda, _mta
from aiak.ops._capability import (
    REFERENCE_DTYPES,
    Capability,
    check_scalar_tensor,
    check_tensor_list,
    declare,
    is_dense,
    use_kernel,
)
from aiak.ops._driver import Kernel
from aiak.ops._registry import define

__all__ = ["multi_tensor_scale_"]

CAP = declare(Capability("multi_tensor_scale_"))
_SCALE = Kernel("multi_tensor_scale.cu", "mt_scale", "ptr table, i32 T, ptr scale, ptr found_inf")
_dtype = operator.attrgetter("dtype")
_BLOCK = 512  # threads per chunk block; __launch_bounds__(512) in the source


def _check_scale_args(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> torch.device | None:
    op = "multi_tensor_scale_"
    device = check_tensor_list(op, "src", src, REFERENCE_DTYPES)
    dst_device = check_tensor_list(op, "dst", dst, REFERENCE_DTYPES)
    if len(src) != len(dst):
        raise ValueError(f"{op}: src has {len(src)} tensors but dst has {len(dst)}")
    if src and dst_device != device:
        raise ValueError(f"{op}: dst is on {dst_device} but src is on {device}")
    check_scalar_tensor(op, "scale", scale, device, torch.float32)
    check_scalar_tensor(op, "found_inf", found_inf, device, torch.float32)
    # Pairs match by element count, as in apex (a flat master may stand for a shaped grad).
    # Fast path, in C-level passes: same counts, everything contiguous.
    if (
        list(map(torch.Tensor.numel, src)) == list(map(torch.Tensor.numel, dst))
        and _all_contiguous(src)
        and _all_contiguous(dst)
    ):
        return device
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.numel() != d.numel():
            raise ValueError(
                f"{op}: dst[{i}] has {d.numel()} elements (shape {tuple(d.shape)}) but src[{i}] "
                f"has {s.numel()} (shape {tuple(s.shape)})"
            )
        if s.shape != d.shape and not (s.is_contiguous() and d.is_contiguous()):
            raise ValueError(
                f"{op}: src[{i}] and dst[{i}] differ in shape ({tuple(s.shape)} vs "
                f"{tuple(d.shape)}), which is only defined for contiguous tensors"
            )
        if s.is_contiguous() and d.is_contiguous():
            continue
        # Elementwise over memory is only defined when both walk their elements in the same
        # order: same strides and dense (no gaps, no overlap).
        if s.numel() > 1 and not (is_dense(s) and is_dense(d) and s.stride() == d.stride()):
            raise ValueError(
                f"{op}: src[{i}] (strides {s.stride()}) and dst[{i}] (strides {d.stride()}) must "
                "be dense with the same memory layout; call .contiguous() on them first"
            )
    return device


def _scale_reference(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    _check_scale_args(src, dst, scale, found_inf)
    if not src:
        return
    s = scale.reshape(())
    bad = []
    for a, b in zip(src, dst):
        x = a if a.dtype == torch.float64 else a.float()
        bad.append(torch.isfinite(x).logical_not().any())
        y = x * s  # fp32 product, rounded once to dst's dtype by copy_, as the kernel does
        if b.shape == y.shape:
            b.copy_(y)
        else:  # same count, both contiguous (checked): element i to element i
            b.view(-1).copy_(y.reshape(-1))
    any_bad = torch.stack(bad).any()
    # torch.where keeps it on device: no host synchronisation.
    found_inf.copy_(torch.where(any_bad, torch.ones_like(found_inf), found_inf))


def _all_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(torch.Tensor.is_contiguous, tensors))


def _scale_cuda(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    tab = _mta.cached("multi_tensor_scale_", [src, dst]) if src else None
    if tab is not None and use_kernel(CAP, tab.data.device, tab.dtypes):
        device = tab.data.device
        check_scalar_tensor("multi_tensor_scale_", "scale", scale, device, torch.float32)
        check_scalar_tensor("multi_tensor_scale_", "found_inf", found_inf, device, torch.float32)
    else:
        device = _check_scale_args(src, dst, scale, found_inf)
        if not src:
            return
        if not use_kernel(CAP, device, set(map(_dtype, src)) | set(map(_dtype, dst))):
            _scale_reference(src, dst, scale, found_inf)
            return
        tab = _mta.table([src, dst], device, "multi_tensor_scale_")
    with _cuda.on_device(device):
        if tab.num_chunks:
            _SCALE(tab.num_chunks, _BLOCK, tab.data, len(src), scale, found_inf)


def _scale_fake(
    src: list[torch.Tensor], dst: list[torch.Tensor], scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    _check_scale_args(src, dst, scale, found_inf)


SCALE_OP = define(
    "multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf) -> ()",
    _scale_reference,
    cuda=_scale_cuda,
    fake=_scale_fake,
)


def multi_tensor_scale_(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dst[i] = src[i] * scale`` (dtype converted), flagging non-finite ``src`` values.

    ``found_inf`` (a one-element fp32 tensor, created as 0 when None) is set to 1 if any src
    element is inf or NaN and is returned; it is never cleared. ``dst`` may be ``src`` itself.
    """
    src, dst = list(src), list(dst)
    device = src[0].device if src else torch.device("cpu")
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), float(scale), dtype=torch.float32, device=device)
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    SCALE_OP(src, dst, scale, found_inf)
    return found_inf
