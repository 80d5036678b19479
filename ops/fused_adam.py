"""``aiak::fused_adam_``: Adam/AdamW (torch.optim's math) over a whole list of params in place.

One CUDA launch for the update (``kernels/fused_adam.cu``) plus one tiny launch that advances
the step counters; mixed fp32/fp16/bf16 params on one device. Conventions shared with the other
fused optimizer ops (state steps, GradScaler's grad_scale/found_inf, lr_tensor, copy_to):
``ops/_fused.py``.

Read top-down: the schema (the argument record ``fused_adam_.Args`` is made from it), checks,
the reference (the one math in PyTorch: CPU, float64, no CuPy, and the conformance ground
truth), the CUDA launcher, the op.
"""

from __future__ import annotations

import torch

from aiak.ops import _fused, _mta
from aiak.ops._capability import check_aligned_lists, check_hyper
from aiak.ops._driver import Kernel
from aiak.ops._registry import define, record

__all__ = ["fused_adam_"]

CAP = _fused.capability("fused_adam_")
_SOURCE = "fused_adam.cu"
_ADAM = Kernel(
    _SOURCE,
    "fused_adam",
    "ptr table, i32 T, i32 D, ptr lr_ptr, f32 lr, f32 beta1, f32 beta2, f32 eps, f32 wd, "
    "i32 flags, ptr grad_scale, ptr found_inf",
)
_BUMP = Kernel(_SOURCE, "bump_steps", "ptr table, i32 T, i32 list, ptr found_inf")

SCHEMA = (
    "fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
    "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, "
    "Tensor(g!)[] copy_to, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool adam_w_mode, bool amsgrad, bool maximize, bool bias_correction, "
    "Tensor? grad_scale, Tensor? found_inf) -> ()"
)
Args = record(SCHEMA)


def _check_scalars(a: Args) -> None:
    check_hyper(
        "fused_adam_", lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay
    )
    _fused.check_scalar_tensors(
        "fused_adam_", a, lr_tensor=a.lr_tensor, grad_scale=a.grad_scale, found_inf=a.found_inf
    )


def _check(a: Args) -> torch.device | None:
    _check_scalars(a)
    same = {"grads": a.grads, "exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs}
    if a.amsgrad:
        same["max_exp_avg_sqs"] = a.max_exp_avg_sqs
    scalars = {"lr_tensor": a.lr_tensor, "grad_scale": a.grad_scale, "found_inf": a.found_inf}
    return check_aligned_lists("fused_adam_", a.params, same, a.copy_to, a.state_steps, scalars)


def _reference(a: Args) -> None:
    """torch._foreach ops in torch's foreach Adam order (for fp32 params on CPU the result is
    torch's, bit for bit); fp16/bf16 are computed in fp32, float64 in float64."""
    _check(a)
    if not a.params:
        return
    params, grads, beta1, beta2 = a.params, a.grads, a.beta1, a.beta2
    vmax_in = a.max_exp_avg_sqs if a.amsgrad else []
    mutated = [*params, *a.exp_avgs, *a.exp_avg_sqs, *vmax_in, *a.state_steps, *a.copy_to]
    if a.grad_scale is not None:
        mutated += grads

    def update() -> None:
        p, m, v, vmax = map(_fused.upcast, (params, a.exp_avgs, a.exp_avg_sqs, vmax_in))
        g = _fused.upcast(grads)
        if a.grad_scale is not None:
            # Unscaled grads are written back, as torch's fused optimizers do.
            g = torch._foreach_div(g, _fused.scale_of(a.grad_scale))
            torch._foreach_copy_(list(grads), g)
        if a.maximize:
            g = torch._foreach_neg(g)
        lr = _fused.rate(a.lr, a.lr_tensor)
        torch._foreach_add_(a.state_steps, 1.0)
        if a.weight_decay != 0:
            if a.adam_w_mode:
                torch._foreach_mul_(p, 1 - lr * a.weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=a.weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        steps = a.state_steps
        if a.bias_correction:
            step_size = _fused.coefficients(steps, lambda s: (lr / (1 - beta1**s)) * -1)
            bc2_sqrt = _fused.coefficients(steps, lambda s: (1 - beta2**s) ** 0.5)
        else:
            step_size, bc2_sqrt = [-lr] * len(p), None
        if a.amsgrad:
            torch._foreach_maximum_(vmax, v)
        denom = torch._foreach_sqrt(vmax if a.amsgrad else v)
        if bc2_sqrt is not None:
            torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, a.eps)
        if isinstance(step_size[0], torch.Tensor):
            upd = torch._foreach_div(m, denom)
            torch._foreach_mul_(upd, step_size)
            torch._foreach_add_(p, upd)
        else:
            torch._foreach_addcdiv_(p, m, denom, step_size)
        for dst, work in ((params, p), (a.exp_avgs, m), (a.exp_avg_sqs, v), (vmax_in, vmax)):
            _fused.store(dst, work)
        _fused.copy_back(a.copy_to, params)

    _fused.unless_found_inf(a.found_inf, mutated, update)


def _lists(a: Args) -> list:
    # The kernel's list order: p, g, m, v, step, copy_to, [max_v].
    copy_to = _fused.copy_list(a.copy_to, len(a.params), a.params[0].device)
    lists = [a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.state_steps, copy_to]
    return [*lists, a.max_exp_avg_sqs] if a.amsgrad else lists


def _launch(a: Args, tab: _mta.Table) -> None:
    n = len(a.params)
    flags = _fused.flags(
        adamw=a.adam_w_mode,
        amsgrad=a.amsgrad,
        maximize=a.maximize,
        bias_correction=a.bias_correction,
    )
    if tab.num_chunks:
        _ADAM(
            tab.num_chunks, _fused.BLOCK, tab.data, n, tab.depth, a.lr_tensor,
            a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, flags, a.grad_scale, a.found_inf,
        )  # fmt: skip
    # The steps advance after the update has read them (stream order); list 4 holds them.
    _BUMP((n + 255) // 256, 256, tab.data, n, 4, a.found_inf)


KERNEL = _fused.Kernel(CAP, _lists, _check, _check_scalars, _launch, _reference)
fused_adam_ = define(
    SCHEMA,
    _fused.positional(_reference, Args),
    cuda=_fused.cuda_impl(KERNEL, Args),
    fake=_fused.positional(_check, Args),  # the op returns nothing: the fake only validates
    binder=_fused.bind,
)
