"""``aiak::fused_lamb_``: LAMB with apex FusedLAMB's math over a whole list of params in place,
given the global grad norm in parts (``grad_norms``: ``aiak::multi_tensor_l2norm`` of the
still-scaled grads on each device that holds some; one tensor on one device)::

    N = sqrt(sum of grad_norms[i]^2)                (grad_norms[0] itself when it is the only one)
    clip = G / max_grad_norm if G > max_grad_norm > 0 else 1      (G = N / grad_scale)
    g' = g / clip  (+ weight_decay * p when adam_w_mode is False: L2 mode)
    m = b1 m + b3 g'  (b3 = 1 - b1 with grad_averaging, else 1);  v = b2 v + (1 - b2) g'^2
    u = (m / bc1) / (sqrt(v / bc2) + eps)  (+ weight_decay * p in adam_w_mode)
    ratio = lr ||p|| / ||u||  if (use_nvlamb or weight_decay != 0) and both norms > 0, else lr
    p -= ratio u

Two CUDA passes (``kernels/fused_lamb.cu``); ``updates`` is the fp32 workspace between them.
Shared conventions: ``ops/_fused.py``. Read top-down: schema, checks, reference, launcher, op.
"""

from __future__ import annotations

import torch

from aiak.ops import _fused, _mta
from aiak.ops._capability import (
    check_aligned_lists,
    check_hyper,
    check_scalar_tensor,
)
from aiak.ops._driver import Kernel
from aiak.ops._registry import define, record

__all__ = ["fused_lamb_"]

CAP = _fused.capability("fused_lamb_")
_STAGE1 = Kernel(
    "fused_lamb.cu",
    "fused_lamb_stage1",
    "ptr table, i32 T, i32 D, ptr partials, f32 beta1, f32 beta2, f32 eps, f32 wd, "
    "f32 max_grad_norm, i32 flags, ptr grad_norm, ptr grad_scale, ptr found_inf",
)
_STAGE2 = Kernel(
    "fused_lamb.cu",
    "fused_lamb_stage2",
    "ptr table, i32 T, i32 D, i32 C, ptr partials, ptr lr_ptr, f32 lr, f32 wd, i32 flags, "
    "ptr found_inf",
)

SCHEMA = (
    "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] updates, Tensor(e!)[] state_steps, "
    "Tensor(f!)[] copy_to, Tensor[] grad_norms, float lr, Tensor? lr_tensor, float beta1, "
    "float beta2, float eps, float weight_decay, bool bias_correction, bool grad_averaging, "
    "bool adam_w_mode, bool use_nvlamb, float max_grad_norm, Tensor? grad_scale, "
    "Tensor? found_inf) -> ()"
)
Args = record(SCHEMA)


def _check_scalars(a: Args) -> None:
    op = "fused_lamb_"
    check_hyper(op, lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
    if isinstance(a.max_grad_norm, bool) or not isinstance(a.max_grad_norm, (int, float)):
        raise TypeError(f"{op}: max_grad_norm must be a float")
    if a.max_grad_norm != a.max_grad_norm:
        raise ValueError(f"{op}: max_grad_norm is NaN")
    _fused.check_scalar_tensors(
        op, a, lr_tensor=a.lr_tensor, grad_scale=a.grad_scale, found_inf=a.found_inf
    )
    norms = a.grad_norms
    if not isinstance(norms, (list, tuple)):
        raise TypeError(f"{op}: grad_norms must be a list of tensors, got {type(norms).__name__}")
    if not norms and a.params:
        raise ValueError(f"{op}: grad_norms must be a non-empty list of one-element tensors")
    for i, t in enumerate(norms):  # on any device: the parts of a multi-device global norm
        check_scalar_tensor(op, f"grad_norms[{i}]", t, None, torch.float32)


def _check(a: Args) -> torch.device | None:
    _check_scalars(a)
    same = {
        "grads": a.grads,
        "exp_avgs": a.exp_avgs,
        "exp_avg_sqs": a.exp_avg_sqs,
        "updates": a.updates,
    }
    scalars = {
        "lr_tensor": a.lr_tensor,
        "grad_scale": a.grad_scale,
        "found_inf": a.found_inf,
    }
    return check_aligned_lists("fused_lamb_", a.params, same, a.copy_to, a.state_steps, scalars)


def global_norm(grad_norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The global grad norm from its parts, on ``device``: the one part itself when it is
    there already (the usual, single-device case: no work at all)."""
    if len(grad_norms) == 1 and grad_norms[0].device == device:
        return grad_norms[0]
    parts = [n.reshape(()).to(device, non_blocking=True) for n in grad_norms]
    return torch.linalg.vector_norm(torch.stack(parts))


def _reference(a: Args) -> None:
    """torch._foreach ops; fp32 arithmetic for fp16/bf16 params, float64 for float64 ones."""
    _check(a)
    if not a.params:
        return
    params, grads, beta1, beta2, wd = a.params, a.grads, a.beta1, a.beta2, a.weight_decay
    mutated = [*params, *a.exp_avgs, *a.exp_avg_sqs, *a.updates, *a.state_steps, *a.copy_to]

    def update() -> None:
        p, m, v = map(_fused.upcast, (params, a.exp_avgs, a.exp_avg_sqs))
        scale = 1.0 if a.grad_scale is None else _fused.scale_of(a.grad_scale)
        norm = global_norm(a.grad_norms, params[0].device).reshape(()) / scale
        clip = torch.ones_like(norm)
        if a.max_grad_norm > 0:
            clip = torch.where(norm > a.max_grad_norm, norm / a.max_grad_norm, clip)
        g = torch._foreach_div(_fused.upcast(grads), clip * scale)
        if not a.adam_w_mode and wd != 0:
            torch._foreach_add_(g, p, alpha=wd)
        torch._foreach_add_(a.state_steps, 1.0)
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=1 - beta1 if a.grad_averaging else 1.0)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        if a.bias_correction:
            bc1 = _fused.coefficients(a.state_steps, lambda s: 1 - beta1**s)
            bc2 = _fused.coefficients(a.state_steps, lambda s: 1 - beta2**s)
            u, denom = torch._foreach_div(m, bc1), torch._foreach_div(v, bc2)
        else:
            u, denom = torch._foreach_mul(m, 1.0), torch._foreach_mul(v, 1.0)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, a.eps)
        torch._foreach_div_(u, denom)
        if a.adam_w_mode and wd != 0:
            torch._foreach_add_(u, p, alpha=wd)
        lr = _fused.rate(a.lr, a.lr_tensor)
        # Norms in the working dtype: fp32, or float64 when a param is float64.
        wide = torch.float64 if any(t.dtype == torch.float64 for t in p) else torch.float32
        pn = torch.stack([n.to(wide) for n in torch._foreach_norm(p, 2)])
        un = torch.stack([n.to(wide) for n in torch._foreach_norm(u, 2)])
        ratio = torch.ones_like(pn) * lr
        if a.use_nvlamb or wd != 0:
            ratio = torch.where((pn > 0) & (un > 0), lr * (pn / un), ratio)
        torch._foreach_copy_(list(a.updates), u)
        torch._foreach_mul_(u, list(ratio.unbind()))
        torch._foreach_sub_(p, u)
        for dst, work in ((params, p), (a.exp_avgs, m), (a.exp_avg_sqs, v)):
            _fused.store(dst, work)
        _fused.copy_back(a.copy_to, params)

    _fused.unless_found_inf(a.found_inf, mutated, update)


def _lists(a: Args) -> list:
    # The kernels' list order: p, g, m, v, update, step, copy_to.
    copy_to = _fused.copy_list(a.copy_to, len(a.params), a.params[0].device)
    return [a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.updates, a.state_steps, copy_to]


def _launch(a: Args, tab: _mta.Table) -> None:
    n, c, device = len(a.params), tab.num_chunks, a.params[0].device
    flags = _fused.flags(
        adamw=a.adam_w_mode,
        bias_correction=a.bias_correction,
        grad_averaging=a.grad_averaging,
        nvlamb=a.use_nvlamb,
    )
    # Per-chunk sums of p^2 and u^2 from stage 1, reduced per tensor by stage 2.
    partials = torch.empty(2 * max(c, 1), dtype=torch.float32, device=device)
    if c:
        _STAGE1(
            c, _fused.BLOCK, tab.data, n, tab.depth, partials,
            a.beta1, a.beta2, a.eps, a.weight_decay, a.max_grad_norm, flags,
            global_norm(a.grad_norms, device), a.grad_scale, a.found_inf,
        )  # fmt: skip
    # Blocks past the c chunks advance the n step counters (ceil(n / BLOCK) of them).
    _STAGE2(
        c + (n + _fused.BLOCK - 1) // _fused.BLOCK, _fused.BLOCK,
        tab.data, n, tab.depth, c, partials, a.lr_tensor, a.lr, a.weight_decay, flags, a.found_inf,
    )  # fmt: skip


KERNEL = _fused.Kernel(CAP, _lists, _check, _check_scalars, _launch, _reference)
fused_lamb_ = define(
    SCHEMA,
    _fused.positional(_reference, Args),
    cuda=_fused.cuda_impl(KERNEL, Args),
    fake=_fused.positional(_check, Args),
    binder=_fused.bind,
)
