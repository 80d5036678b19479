"""``aiak::fused_sgd_``: SGD (torch.optim's math: momentum, dampening, nesterov, weight decay,
maximize) over a whole list of params in place, one CUDA launch (``kernels/fused_sgd.cu``).

``scales`` (LARS): per-tensor fp32 factors on the decayed grad. ``is_first_step``: the momentum
buffers are set to the (decayed, scaled) grad instead of averaged into, as torch's first step.
Shared conventions: ``ops/_fused.py``. Read top-down: schema, checks, reference, launcher, op.
"""

from __future__ import annotations

import torch

from aiak.ops import _fused, _mta
from aiak.ops._capability import check_aligned_lists, check_hyper
from aiak.ops._driver import Kernel
from aiak.ops._registry import define, record

__all__ = ["fused_sgd_"]

CAP = _fused.capability("fused_sgd_")
_SGD = Kernel(
    "fused_sgd.cu",
    "fused_sgd",
    "ptr table, i32 T, i32 D, ptr lr_ptr, f32 lr, f32 momentum, f32 dampening, f32 wd, "
    "i32 flags, ptr scales, ptr grad_scale, ptr found_inf",
)

SCHEMA = (
    "fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
    "Tensor(d!)[] copy_to, float lr, Tensor? lr_tensor, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool maximize, bool is_first_step, Tensor? scales, "
    "Tensor? grad_scale, Tensor? found_inf) -> ()"
)
Args = record(SCHEMA)


def _check_scalars(a: Args) -> None:
    op = "fused_sgd_"
    check_hyper(
        op, lr=a.lr, momentum=a.momentum, dampening=a.dampening, weight_decay=a.weight_decay
    )
    if a.nesterov and (a.momentum <= 0 or a.dampening != 0):
        raise ValueError(f"{op}: nesterov needs momentum > 0 and dampening 0")
    _fused.check_scalar_tensors(
        op, a, lr_tensor=a.lr_tensor, grad_scale=a.grad_scale, found_inf=a.found_inf
    )
    if a.scales is not None:
        n = len(a.params)
        if not isinstance(a.scales, torch.Tensor) or a.scales.dtype != torch.float32:
            raise TypeError(f"{op}: scales must be a float32 tensor")
        if a.scales.shape != (n,) or (n and a.scales.device != a.params[0].device):
            raise ValueError(f"{op}: scales must have shape ({n},) on the params' device")


def _check(a: Args) -> torch.device | None:
    op = "fused_sgd_"
    check_hyper(op, momentum=a.momentum)
    same = {"grads": a.grads}
    if a.momentum != 0:
        same["momentum_buffers"] = a.momentum_buffers
    elif a.momentum_buffers:
        raise ValueError(f"{op}: momentum_buffers must be empty when momentum is 0")
    scalars = {"lr_tensor": a.lr_tensor, "grad_scale": a.grad_scale, "found_inf": a.found_inf}
    device = check_aligned_lists(op, a.params, same, a.copy_to, None, scalars)
    _check_scalars(a)
    return device


def _reference(a: Args) -> None:
    """torch._foreach ops in torch's foreach SGD order (fp32 arithmetic for fp16/bf16)."""
    _check(a)
    if not a.params:
        return
    params, grads, bufs_in = a.params, a.grads, a.momentum_buffers
    mutated = [*params, *bufs_in, *a.copy_to]
    if a.grad_scale is not None:
        mutated += grads

    def update() -> None:
        p, bufs = _fused.upcast(params), _fused.upcast(bufs_in)
        g = _fused.upcast(grads)
        if a.grad_scale is not None:
            g = torch._foreach_div(g, _fused.scale_of(a.grad_scale))
            torch._foreach_copy_(list(grads), g)
        if a.maximize:
            g = torch._foreach_neg(g)
        if a.weight_decay != 0:
            g = torch._foreach_add(g, p, alpha=a.weight_decay)
        if a.scales is not None:
            g = torch._foreach_mul(g, list(a.scales.unbind()))
        if a.momentum != 0:
            if a.is_first_step:
                torch._foreach_copy_(bufs, g)
            else:
                torch._foreach_mul_(bufs, a.momentum)
                torch._foreach_add_(bufs, g, alpha=1 - a.dampening)
            g = torch._foreach_add(g, bufs, alpha=a.momentum) if a.nesterov else bufs
        lr = _fused.rate(a.lr, a.lr_tensor)
        if isinstance(lr, torch.Tensor):
            torch._foreach_sub_(p, torch._foreach_mul(g, lr))
        else:
            torch._foreach_add_(p, g, alpha=-lr)
        _fused.store(params, p)
        _fused.store(bufs_in, bufs)
        _fused.copy_back(a.copy_to, params)

    _fused.unless_found_inf(a.found_inf, mutated, update)


def _lists(a: Args) -> list:
    # The kernel's list order: p, g, copy_to, [momentum_buffer].
    copy_to = _fused.copy_list(a.copy_to, len(a.params), a.params[0].device)
    lists = [a.params, a.grads, copy_to]
    return [*lists, a.momentum_buffers] if a.momentum != 0 else lists


def _launch(a: Args, tab: _mta.Table) -> None:
    if not tab.num_chunks:
        return
    flags = _fused.flags(nesterov=a.nesterov, maximize=a.maximize, first_step=a.is_first_step)
    _SGD(
        tab.num_chunks, _fused.BLOCK, tab.data, len(a.params), tab.depth, a.lr_tensor,
        a.lr, a.momentum, a.dampening, a.weight_decay, flags, a.scales, a.grad_scale, a.found_inf,
    )  # fmt: skip


KERNEL = _fused.Kernel(CAP, _lists, _check, _check_scalars, _launch, _reference)
fused_sgd_ = define(
    SCHEMA,
    _fused.positional(_reference, Args),
    cuda=_fused.cuda_impl(KERNEL, Args),
    fake=_fused.positional(_check, Args),
    binder=_fused.bind,
)
