"""FusedSGD: torch.optim.SGD's math and state (``momentum_buffer``) in one launch per device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from aiak.optim import _common as C

__all__ = ["FusedSGD"]


class FusedSGD(C.FusedOptimizer):
    """SGD with momentum, dampening, nesterov, weight decay, ``maximize`` (torch.optim.SGD).

    On the first step a param's ``momentum_buffer`` is set to its decayed grad, as in torch.
    (When GradScaler skips that very first step, the buffer is left at zero.)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, group: dict, index: int) -> None:
        owner = f"{type(self).__name__} (param_groups[{index}])"
        C.check_nonnegative(
            owner,
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
        )
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{owner}: nesterov needs momentum > 0 and dampening 0")

    def _plan_key(self, group: dict) -> Any:
        return sgd_plan_key(group)

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        return sgd_plan_lists(self, group, params)

    def _step_group(self, plan: C.Plan, grads: list[torch.Tensor]) -> None:
        sgd_step(self, plan, grads, scales=None)


def sgd_plan_key(group: dict) -> Any:
    return float(group.get("momentum", 0.0)) != 0


def sgd_plan_lists(
    opt: C.FusedOptimizer, group: dict, params: list[torch.Tensor]
) -> dict[str, list]:
    """The momentum buffers (created, zero, for params on their first step) and which params
    are on their first step: ``first`` holds their positions (empty in the steady state)."""
    if not sgd_plan_key(group):
        return {"momentum_buffers": [], "first": []}
    states = [opt.state[p] for p in params]
    first = [i for i, st in enumerate(states) if "momentum_buffer" not in st]
    for i in first:
        states[i]["momentum_buffer"] = torch.zeros_like(
            params[i], memory_format=torch.preserve_format
        )
    return {"momentum_buffers": [st["momentum_buffer"] for st in states], "first": first}


def sgd_step(
    opt: C.FusedOptimizer,
    plan: C.Plan,
    grads: list[torch.Tensor],
    scales: torch.Tensor | None,
    checked: bool = False,
) -> None:
    """One SGD update of ``plan.params`` (LARS passes its per-tensor trust ratios as ``scales``,
    and its grads through ``C.checked_grads`` already: ``checked``).

    Params whose momentum buffer exists and those on their first step are two calls, as the
    first step sets the buffer instead of averaging into it; a plan with first-step params is
    used once (the next step rebuilds it, all buffers existing).
    """
    group, device, params = plan.group, plan.device, plan.params
    momentum = float(group.get("momentum", 0.0))
    lr, lr_tensor = C.lr_args(group["lr"], device)
    grad_scale, found_inf = C.amp_args(opt, device)
    kernel = plan.kernel_dtypes and C.use_ops(device)
    if not checked:
        grads = C.checked_grads(type(opt).__name__, plan, grads, kernel)
    bufs, copy_to = plan.lists["momentum_buffers"], plan.copy_to
    first = plan.lists["first"]
    if first:
        plan.stale = True
        is_first = set(first)
        rest = [i for i in range(len(params)) if i not in is_first]
        parts = [(False, rest), (True, first)]
    else:
        parts = [(False, None)]
    for step_is_first, idx in parts:
        if idx is not None and not idx:
            continue
        lists = (params, grads, bufs, copy_to)
        sub_scales = scales
        if idx is not None:
            lists = tuple([t[i] for i in idx] if t else [] for t in lists)
            sub_scales = None if scales is None else scales[idx]
        kw = {
            "lr": lr,
            "lr_tensor": lr_tensor,
            "momentum": momentum,
            "dampening": float(group.get("dampening", 0.0)),
            "weight_decay": float(group["weight_decay"]),
            "nesterov": bool(group.get("nesterov", False)),
            "maximize": bool(group.get("maximize", False)),
            "is_first_step": step_is_first,
            "scales": sub_scales,
            "grad_scale": grad_scale,
            "found_inf": found_inf,
        }
        if kernel:
            C.op("fused_sgd_")(*lists, *kw.values())
        else:
            sgd_foreach(*lists, **kw)


def sgd_foreach(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    copy_to: Sequence[torch.Tensor],
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
    scales: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """``aiak::fused_sgd_`` with torch._foreach ops, in torch's foreach SGD op order."""
    mutated = [*params, *momentum_buffers, *copy_to]
    if grad_scale is not None:
        mutated += grads

    def update() -> None:
        p, bufs = C.upcast(params), C.upcast(momentum_buffers)
        g = C.upcast(grads)
        if grad_scale is not None:
            g = torch._foreach_div(g, grad_scale.reshape(()))
            torch._foreach_copy_(list(grads), g)
        if maximize:
            g = torch._foreach_neg(g)
        if weight_decay != 0:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        if scales is not None:
            g = torch._foreach_mul(g, list(scales.unbind()))
        if momentum != 0:
            if is_first_step:
                torch._foreach_copy_(bufs, g)
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, g, alpha=1 - dampening)
            g = torch._foreach_add(g, bufs, alpha=momentum) if nesterov else bufs
        if lr_tensor is None:
            torch._foreach_add_(p, g, alpha=-lr)
        else:
            torch._foreach_sub_(p, torch._foreach_mul(g, lr_tensor.reshape(())))
        C.store(params, p)
        C.store(momentum_buffers, bufs)
        C.copy_back(copy_to, params)

    C.unless_found_inf(found_inf, mutated, update)
