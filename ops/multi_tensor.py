"""Multi-tensor ops: ``aiak::multi_tensor_l2norm`` and ``aiak::multi_tensor_scale_``.

Read top-down: input checks, the PyTorch reference (the default kernel, ground truth of the
conformance suite, used on CPU and whenever the CUDA kernel cannot run), the CUDA launchers
(one launch, or two for the norm, over a whole tensor list via ``ops/_mta.py``), then the op
declarations (``ops/_registry.py``) with their fake and autograd registrations.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from aiak.ops import _cuda, _mta
from aiak.ops._capability import (
    FLOAT_DTYPES,
    Capability,
    check_scalar_tensor,
    check_tensor_list,
    declare,
    is_dense,
    use_kernel,
)
from aiak.ops._registry import LIB, define

__all__ = ["multi_tensor_l2norm", "multi_tensor_scale_"]

L2NORM = declare(Capability("multi_tensor_l2norm"))
SCALE = declare(Capability("multi_tensor_scale_"))
_SOURCE = "multi_tensor.cu"
_dtype = operator.attrgetter("dtype")
_BLOCK = 512  # threads per chunk block; __launch_bounds__(512) in the source


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _check_scale_args(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> torch.device | None:
    op = "multi_tensor_scale_"
    device = check_tensor_list(op, "src", src, FLOAT_DTYPES)
    dst_device = check_tensor_list(op, "dst", dst, FLOAT_DTYPES)
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


# --------------------------------------------------------------------------------------------
# Reference (default kernel)
# --------------------------------------------------------------------------------------------


def _norms_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One fp32 L2 norm per tensor, stacked."""
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])


def _l2norm_reference(
    tensors: Sequence[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, FLOAT_DTYPES)
    if not tensors:
        return torch.zeros((), dtype=torch.float32), torch.zeros(0, dtype=torch.float32)
    norms = _norms_reference(tensors)
    total = torch.linalg.vector_norm(norms)
    per = norms if per_tensor else torch.zeros(0, dtype=torch.float32, device=device)
    return total, per


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
        x = a.float()
        bad.append(torch.isfinite(x).logical_not().any())
        y = x * s  # fp32 product, rounded once to dst's dtype by copy_, as the kernel does
        if b.shape == y.shape:
            b.copy_(y)
        else:  # same count, both contiguous (checked): element i to element i
            b.view(-1).copy_(y.reshape(-1))
    any_bad = torch.stack(bad).any()
    # torch.where keeps it on device: no host synchronisation.
    found_inf.copy_(torch.where(any_bad, torch.ones_like(found_inf), found_inf))


# --------------------------------------------------------------------------------------------
# CUDA launchers
# --------------------------------------------------------------------------------------------


def _validated_table(tag: str, lists: list[Sequence[torch.Tensor]]) -> _mta.Table | None:
    """The table of a tensor set this op has validated before, or None (then validate).

    A table is cached only after its set passed the op's checks, under a key of addresses,
    sizes and dtypes; addresses fix the device. What the key cannot see is layout, so the
    fast path requires contiguous tensors. On the H100 machine's host this skips ~800 µs of
    per-tensor checks per call on 389 tensors.
    """
    if not all(map(_all_contiguous, lists)):
        return None
    return _mta.lookup(_mta.key(tag, lists))


def _all_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(torch.Tensor.is_contiguous, tensors))


def _l2norm_cuda(
    tensors: Sequence[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    tab = _validated_table("l2norm", [tensors])
    if tab is not None and use_kernel(L2NORM, tab.data.device, set(map(_dtype, tensors))):
        return _l2norm_launch(tab, len(tensors), per_tensor)
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, FLOAT_DTYPES)
    if not use_kernel(L2NORM, device, set(map(_dtype, tensors))):
        return _l2norm_reference(tensors, per_tensor)
    # A strided view (every other row, say) has a defined norm: walk a dense copy of it.
    ts = tensors
    if not _all_contiguous(tensors):
        ts = [t if is_dense(t) else t.contiguous() for t in tensors]
    with _cuda.on_device(device):
        return _l2norm_launch(_mta.table([ts], device, "l2norm"), len(ts), per_tensor)


def _l2norm_launch(tab: _mta.Table, n: int, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    device = tab.data.device
    with _cuda.on_device(device):
        total = torch.empty((), dtype=torch.float32, device=device)
        per = torch.empty(n if per_tensor else 0, dtype=torch.float32, device=device)
        partials = torch.empty(max(tab.num_chunks, 1), dtype=torch.float32, device=device)
        if tab.num_chunks:
            fn = _cuda.get_function(_SOURCE, "mt_l2norm_partial")
            _cuda.launch(
                fn, tab.num_chunks, _BLOCK, (_cuda.ptr(tab.data), _cuda.i32(n), _cuda.ptr(partials))
            )
        fn = _cuda.get_function(_SOURCE, "mt_l2norm_finalize")
        _cuda.launch(
            fn,
            1,
            1024,
            (
                _cuda.ptr(tab.data),
                _cuda.i32(n),
                _cuda.ptr(partials),
                _cuda.ptr(per if per_tensor else None),
                _cuda.ptr(total),
            ),
        )
    return total, per


def _scale_cuda(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    dtypes = set(map(_dtype, src)) | set(map(_dtype, dst))
    tab = _validated_table("scale", [src, dst]) if src else None
    if tab is not None and use_kernel(SCALE, tab.data.device, dtypes):
        device = tab.data.device
        check_scalar_tensor("multi_tensor_scale_", "scale", scale, device, torch.float32)
        check_scalar_tensor("multi_tensor_scale_", "found_inf", found_inf, device, torch.float32)
    else:
        device = _check_scale_args(src, dst, scale, found_inf)
        if not src:
            return
        if not use_kernel(SCALE, device, dtypes):
            _scale_reference(src, dst, scale, found_inf)
            return
        tab = _mta.table([src, dst], device, "scale")
    with _cuda.on_device(device):
        if tab.num_chunks:
            fn = _cuda.get_function(_SOURCE, "mt_scale")
            _cuda.launch(
                fn,
                tab.num_chunks,
                _BLOCK,
                (_cuda.ptr(tab.data), _cuda.i32(len(src)), _cuda.ptr(scale), _cuda.ptr(found_inf)),
            )


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


def _l2norm_fake(
    tensors: list[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, FLOAT_DTYPES)
    device = device if device is not None else torch.device("cpu")
    total = torch.empty((), dtype=torch.float32, device=device)
    per = torch.empty(len(tensors) if per_tensor else 0, dtype=torch.float32, device=device)
    return total, per


def _l2norm_setup(ctx, inputs, output) -> None:
    tensors, per_tensor = inputs
    total, per = output
    ctx.per_tensor = per_tensor
    ctx.save_for_backward(total, per, *tensors)


def _l2norm_backward(ctx, grad_total, grad_per):
    # d||x||/dx = x / ||x|| (0 where the norm is 0), for the global norm and each per-tensor one.
    total, per, *tensors = ctx.saved_tensors
    grads = []
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    for i, t in enumerate(tensors):
        coef = torch.where(total > 0, grad_total / safe_total, torch.zeros_like(total))
        if ctx.per_tensor and grad_per is not None:
            n = per[i]
            coef = coef + torch.where(n > 0, grad_per[i] / torch.where(n > 0, n, 1.0), 0.0)
        grads.append((t.float() * coef).to(t.dtype))
    return grads, None


def _scale_fake(
    src: list[torch.Tensor], dst: list[torch.Tensor], scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    _check_scale_args(src, dst, scale, found_inf)


L2NORM_OP = define(
    "multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)",
    _l2norm_reference,
    cuda=_l2norm_cuda,
    fake=_l2norm_fake,
    differentiable=True,
)
torch.library.register_autograd(
    "aiak::multi_tensor_l2norm", _l2norm_backward, setup_context=_l2norm_setup, lib=LIB
)
SCALE_OP = define(
    "multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf) -> ()",
    _scale_reference,
    cuda=_scale_cuda,
    fake=_scale_fake,
)


# --------------------------------------------------------------------------------------------
# Python conveniences over torch.ops.aiak.*
# --------------------------------------------------------------------------------------------


def multi_tensor_l2norm(
    tensors: Sequence[torch.Tensor], per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all ``tensors`` together (fp32, 0-dim) and, if ``per_tensor``, one per
    tensor (fp32, ``[len(tensors)]``; otherwise an empty tensor). Never synchronises the host.

    Accepts fp32/fp16/bf16 tensors, mixed, of any sizes (empty ones count 0) on one device.
    """
    return L2NORM_OP(list(tensors), per_tensor)


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
