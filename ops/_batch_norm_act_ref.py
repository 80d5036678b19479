"""``aiak::batch_norm_act``'s checks, PyTorch references (the CPU and fallback path, and the
conformance ground truth) and fakes."""

from __future__ import annotations

from typing import Any

import torch

from aiak.ops._args import check_bool, check_float
from aiak.ops._capability import REFERENCE_DTYPES

_OP = "batch_norm_act"
_HALF_OR_FP32 = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_INF = float("inf")


def _check(
    x: Any, weight: Any, bias: Any, residual: Any, eps: Any, relu: Any, training: bool = True
) -> None:
    """Named errors for the op's arguments (the same on every device and path). The usual call
    (affine, fp32 or half, finite eps) passes one expression; only the rest walks the
    arguments one by one to name the culprit."""
    if (
        type(x) in _PLAIN
        and type(weight) in _PLAIN
        and type(bias) in _PLAIN
        and type(eps) is float
        and 0.0 <= eps < _INF
        and type(relu) is bool
        and x.dtype in _HALF_OR_FP32
        and x.dim() >= 2
        and weight.dtype is bias.dtype
        and weight.dtype in _HALF_OR_FP32
        and weight.shape == bias.shape == x.shape[1:2]
        and weight.is_cuda is x.is_cuda is bias.is_cuda
        and (not x.is_cuda or weight.get_device() == x.get_device() == bias.get_device())
        and (
            residual is None
            or (
                type(residual) in _PLAIN
                and residual.dtype is x.dtype
                and residual.shape == x.shape
                and residual.is_cuda is x.is_cuda
                and (not x.is_cuda or residual.get_device() == x.get_device())
            )
        )
        and (not training or x.numel() > x.shape[1])
    ):
        return
    _explain(x, weight, bias, residual, eps, relu, training)


def _explain(x, weight, bias, residual, eps, relu, training) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_OP}: input must be a Tensor, got {type(x).__name__}")
    if x.dtype not in REFERENCE_DTYPES:
        raise TypeError(f"{_OP}: input must be a float tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{_OP}: input must be [N, C, *], got shape {tuple(x.shape)}")
    c = x.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a Tensor or None, got {type(t).__name__}")
        if t.shape != (c,):
            raise ValueError(f"{_OP}: {name} must be [C] = [{c}], got {tuple(t.shape)}")
        if t.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{_OP}: {name} must be a float tensor, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but input is on {x.device}")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"{_OP}: weight is {weight.dtype} but bias is {bias.dtype}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"{_OP}: residual must be a Tensor or None, got {type(residual).__name__}"
            )
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{_OP}: residual must match input ({tuple(x.shape)}, {x.dtype}), got "
                f"{tuple(residual.shape)}, {residual.dtype}"
            )
        if residual.device != x.device:
            raise ValueError(f"{_OP}: residual is on {residual.device} but input on {x.device}")
    check_float("eps", eps, ge=0.0, op=_OP)
    check_bool("relu", relu, op=_OP)
    if training and x.numel() // max(c, 1) <= 1 and x.numel() > 0:
        raise ValueError(  # F.batch_norm's check
            f"{_OP}: expected more than 1 value per channel when training, got input size "
            f"{tuple(x.shape)}"
        )


def _channels_innermost(x: torch.Tensor) -> bool:
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    if x.dim() == 2:
        return x.is_contiguous()
    return x.movedim(1, -1).is_contiguous()


# -----------------------------------------------------------------------------------


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    relu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, weight, bias, residual, eps, relu)
    acc = _acc(x)
    xf = x.to(acc)
    var, mean = torch.var_mean(xf, dim=_dims(x), correction=0)
    invstd = torch.rsqrt(var + eps)
    y = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight.to(acc), x)
    if bias is not None:
        y = y + _per_channel(bias.to(acc), x)
    if residual is not None:
        y = y + residual.to(acc)
    if relu:
        y = torch.relu(y)
    return y.to(x.dtype).contiguous(memory_format=_layout(x)), mean, invstd


def _layout(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 and _channels_innermost(x) else torch.preserve_format


def _backward_reference(
    grad: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    relu: bool,
    residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _acc(x)
    g = grad.to(acc)
    if relu:  # torch's threshold_backward: zero where y <= 0 (a NaN output passes its grad)
        g = torch.where(y <= 0, torch.zeros((), dtype=acc, device=g.device), g)
    centred = x.to(acc) - _per_channel(mean.to(acc), x)
    m = x.numel() // x.shape[1]
    sum_g = g.sum(_dims(x))
    sum_gx = (g * centred).sum(_dims(x))
    inv = invstd.to(acc)
    w = weight.to(acc) if weight is not None else torch.ones_like(inv)
    a = w * inv
    dx = _per_channel(a, x) * (
        g - _per_channel(sum_g / m, x) - centred * _per_channel(inv * inv * sum_gx / m, x)
    )
    empty = x.new_empty(0)
    dweight = (sum_gx * inv).to(weight.dtype) if weight is not None else empty
    dbias = sum_g.to(bias.dtype) if bias is not None else empty
    dres = g.to(x.dtype).contiguous(memory_format=_layout(x)) if residual else empty
    return dx.to(x.dtype).contiguous(memory_format=_layout(x)), dweight, dbias, dres


def _forward_fake(x, weight, bias, residual, eps, relu):
    _check(x, weight, bias, residual, eps, relu)
    c = x.shape[1]
    stats = (c,)
    acc = _acc(x)
    return torch.empty_like(x), x.new_empty(stats, dtype=acc), x.new_empty(stats, dtype=acc)


def _backward_fake(grad, x, y, weight, bias, mean, invstd, relu, residual):
    empty = x.new_empty(0)
    dweight = torch.empty_like(weight) if weight is not None else empty
    dbias = torch.empty_like(bias) if bias is not None else empty
    return torch.empty_like(x), dweight, dbias, torch.empty_like(x) if residual else empty
