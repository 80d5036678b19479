"""Batch norm with the residual add and ReLU that follow it, in one pass each way.

``batch_norm_act(input, running_mean, running_var, weight, bias, training, momentum, eps,
residual=None, relu=True)`` is, to rounding::

    y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    y = torch.relu(y + residual)  # the add without a residual, the ReLU with relu=True

In training mode on CUDA, with the channels innermost in memory (``channels_last`` for
``[N, C, H, W]``, any ``[N, C]``), it runs four kernels (``kernels/batch_norm_act.cu``):
statistics and normalisation forward, two reductions-and-passes backward. torch runs batch
norm, add and ReLU as separate kernels each way, each reading and writing the whole activation
(the elementwise ReLU/add kernels and their backward are a quarter of ResNet-50's GPU time);
here the ReLU's mask is read from the saved output inside the backward's own passes and the
residual's gradient is written by the same pass as the input's.

The ops: ``aiak::batch_norm_act(x, weight, bias, residual, eps, relu) -> (y, mean, invstd)``
(batch statistics, differentiable in x, weight, bias and residual) and its backward
``aiak::batch_norm_act_backward``. Running statistics are updated as torch does (momentum,
unbiased variance); the eager CUDA path updates them inside the statistics kernel. Evaluation
mode (running statistics) runs torch's own ops. Statistics are fp32 whatever the input's
dtype; every output element is computed in fp32 and rounded once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from aiak.ops import _batch_norm_act_cuda as _bc
from aiak.ops._args import check_bool, check_float
from aiak.ops._batch_norm_act_ref import (
    _INF,
    _OP,
    _PLAIN,
    _backward_fake,
    _backward_reference,
    _channels_innermost,
    _check,
    _forward_fake,
    _forward_reference,
)
from aiak.ops._capability import FLOAT_DTYPES, Capability, declare, use_kernel
from aiak.ops._registry import define, increment_version

__all__ = ["batch_norm_act"]


def _input_reasons(x: torch.Tensor, weight: torch.Tensor | None) -> list[str]:
    reasons = []
    if not _channels_innermost(x):
        reasons.append(f"{_OP}: input's channels are not innermost in memory (use channels_last)")
    if x.numel() == 0:
        reasons.append(f"{_OP}: empty input")
    if weight is not None and weight.dtype not in _bc.WCODE:
        reasons.append(f"{_OP}: weight dtype {weight.dtype} not in (float32, float16, bfloat16)")
    return reasons


CAP = declare(
    Capability(
        _OP,
        dtypes=FLOAT_DTYPES,
        input_reasons=_input_reasons,
        conditions=(
            "training mode (batch statistics)",
            "channels innermost in memory: channels_last for [N, C, H, W], any [N, C]",
        ),
    )
)


def _usable(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return use_kernel(CAP, x.device, (x.dtype,), (x, weight))


def _forward_cuda(x, weight, bias, residual, eps, relu):
    _check(x, weight, bias, residual, eps, relu)
    if not _usable(x, weight if weight is not None else bias):
        return _forward_reference(x, weight, bias, residual, eps, relu)
    c = x.shape[1]
    if residual is not None:
        residual = _bc.like(residual, x)
    plan = _bc.plan_for(x, _bc.aligned(x, residual))
    y, ws = _bc.launch_forward(plan, x, weight, bias, residual, eps, relu)
    return y, ws[:c], ws[c : 2 * c]


def _backward_cuda(grad, x, y, weight, bias, mean, invstd, relu, residual):
    if not _usable(x, weight if weight is not None else bias):
        return _backward_reference(grad, x, y, weight, bias, mean, invstd, relu, residual)
    grad = _bc.like(grad, x)
    mean, invstd = mean.float().contiguous(), invstd.float().contiguous()
    plan = _bc.plan_for(x, _bc.aligned(x, grad, y))
    dx, dweight, dbias, dres = _bc.launch_backward(
        plan, grad, x, y, weight, bias.dtype if bias is not None else None, mean.data_ptr(),
        invstd.data_ptr(), relu, residual,
    )  # fmt: skip
    empty = x.new_empty(0)
    return (
        dx,
        dweight if dweight is not None else empty,
        dbias if dbias is not None else empty,
        dres if dres is not None else empty,
    )


FORWARD_OP = define(
    "batch_norm_act(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, "
    "bool relu) -> (Tensor, Tensor, Tensor)",
    _forward_reference,
    cuda=_forward_cuda,
    fake=_forward_fake,
    differentiable=True,
)
BACKWARD_OP = define(
    "batch_norm_act_backward(Tensor grad, Tensor x, Tensor y, Tensor? weight, Tensor? bias, "
    "Tensor mean, Tensor invstd, bool relu, bool residual) -> (Tensor, Tensor, Tensor, Tensor)",
    _backward_reference,
    cuda=_backward_cuda,
    fake=_backward_fake,
)


# -- autograd -----------------------------------------------------------------------------------
# The op's formula (dispatcher: torch.compile, fake tensors, opcheck) and the eager path's
# (the same kernels called directly, the running statistics updated in the statistics kernel).


def _setup(ctx, inputs, output) -> None:
    x, weight, bias, residual, _eps, relu = inputs
    y, mean, invstd = output
    ctx.save_for_backward(x, y if relu else None, weight, bias, mean, invstd)
    ctx.relu = relu
    ctx.flags = (weight is not None, bias is not None, residual is not None)


def _op_backward(ctx, grad, _grad_mean, _grad_invstd):
    x, y, weight, bias, mean, invstd = ctx.saved_tensors
    has_w, has_b, has_res = ctx.flags
    dx, dweight, dbias, dres = torch.ops.aiak.batch_norm_act_backward(
        grad, x, y if y is not None else x, weight, bias, mean, invstd, ctx.relu, has_res
    )
    return (
        dx,
        dweight if has_w else None,
        dbias if has_b else None,
        dres if has_res else None,
        None,
        None,
    )


torch.library.register_autograd("aiak::batch_norm_act", _op_backward, setup_context=_setup)


class _EagerBatchNormAct(torch.autograd.Function):
    """Five inputs, four of them differentiable: every argument of ``apply`` costs the host a
    wrapper check on the way back, so the rest travels in one tuple (``call``)."""

    @staticmethod
    def forward(ctx, call, x, weight, bias, residual):
        plan, running_mean, running_var, momentum, eps, relu = call
        y, ws = _bc.launch_forward(plan, x, weight, bias, residual, eps, relu, running_mean,
                                   running_var, momentum)  # fmt: skip
        ctx.save_for_backward(x, y, weight, ws)
        ctx.plan, ctx.relu, ctx.residual = plan, relu, residual is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y, weight, ws = ctx.saved_tensors
        if grad.stride() != x.stride():
            grad = _bc.like(grad, x)
        plan = ctx.plan
        if not _bc.aligned(grad):  # the plan assumed whole vectors: a rare unaligned gradient
            plan = _bc.plan_for(x, False)
        mean = ws.data_ptr()
        dx, dweight, dbias, dres = _bc.launch_backward(
            plan, grad, x, y, weight, ctx.bias_dtype, mean, mean + 4 * plan.c, ctx.relu,
            ctx.residual,
        )  # fmt: skip
        return None, dx, dweight, dbias, dres


def _check_running(x: torch.Tensor, mean: Any, var: Any) -> None:
    if mean is None or var is None:
        raise ValueError(f"{_OP}: running_mean and running_var must both be None or both given")
    for name, t in (("running_mean", mean), ("running_var", var)):
        if type(t) not in _PLAIN or t.shape != x.shape[1:2]:
            raise ValueError(f"{_OP}: {name} must be None or a [C] = [{x.shape[1]}] tensor")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but input is on {x.device}")
    if mean.dtype != var.dtype or not mean.dtype.is_floating_point:
        raise TypeError(
            f"{_OP}: running_mean and running_var must be float tensors of one dtype, got "
            f"{mean.dtype} and {var.dtype}"
        )


def _eager_plan(x, weight, bias, residual, running_mean, running_var) -> _bc.Plan | None:
    """The launch plan when this call (its arguments checked) can take the eager kernels, else
    None (the op through the dispatcher)."""
    if (
        type(x) not in _PLAIN
        or not x.is_cuda
        or torch.compiler.is_compiling()
        or _dispatch_mode() is not None
        or not _usable(x, weight if weight is not None else bias)
    ):
        return None
    if residual is not None and residual.stride() != x.stride():
        return None  # the op path copies it into x's layout
    if running_mean is not None and running_mean.dtype not in _bc.WCODE:
        return None  # float64 statistics: the op path updates them with torch's ops
    return _bc.plan_for(x, _bc.aligned(x, residual))


def _update_running(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    momentum: float,
    eps: float,
    count: int,
) -> None:
    """torch's running-statistics update from the batch's mean and invstd."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        if running_var is not None:
            var = (invstd.double().pow(-2) - eps).clamp_min(0) * (count / max(count - 1, 1))
            running_var.lerp_(var.to(running_var.dtype), momentum)


def batch_norm_act(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    relu: bool = True,
) -> torch.Tensor:
    """``F.batch_norm`` (same arguments, same running-statistics update), then ``+ residual``
    (given) and ReLU (``relu=True``), fused in training mode on CUDA when the channels are
    innermost in memory. Evaluation mode runs torch's ops."""
    if type(training) is not bool:
        training = check_bool("training", training, op=_OP)
    _check(input, weight, bias, residual, eps, relu, training)
    if running_mean is not None or running_var is not None:
        _check_running(input, running_mean, running_var)
    if not training:
        y = F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
        if residual is not None:
            y = y + residual
        return torch.relu(y) if relu else y
    if not (type(momentum) is float and -_INF < momentum < _INF):
        momentum = check_float("momentum", momentum, op=_OP)
    eps = float(eps)
    plan = _eager_plan(input, weight, bias, residual, running_mean, running_var)
    if plan is not None:
        call = (plan, running_mean, running_var, momentum, eps, relu)
        y = _EagerBatchNormAct.apply(call, input, weight, bias, residual)
        written = [t for t in (running_mean, running_var) if t is not None]
        if written:
            increment_version(written)
        return y
    y, mean, invstd = FORWARD_OP(input, weight, bias, residual, eps, relu)
    if running_mean is not None or running_var is not None:
        count = input.numel() // input.shape[1]
        _update_running(running_mean, running_var, mean, invstd, momentum, eps, count)
    return y
