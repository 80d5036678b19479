"""FusedSGD: torch.optim.SGD's math and state (``momentum_buffer``) in one launch per device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import aiak.ops
from aiak.optim import _common as C

__all__ = ["FusedSGD"]


class FusedSGD(C.FusedOptimizer):
    """SGD with momentum, dampening, nesterov, weight decay, ``maximize`` (torch.optim.SGD).

    On a param's first applied step its ``momentum_buffer`` is set to its decayed grad, as in
    torch. A step GradScaler skips (inf/NaN grads) is not applied: a param that had no buffer
    before it still has none after it, as in torch (where GradScaler does not call ``step()``).
    Knowing that takes one read of ``found_inf`` on the host, on steps where some param of a
    group has no buffer yet (the first ones); every other step reads nothing on the host.
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
        C.check_flags(owner, group, "nesterov", "maximize")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{owner}: nesterov needs momentum > 0 and dampening 0")

    def _plan_key(self, group: dict) -> Any:
        return sgd_plan_key(group)

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        return sgd_plan_lists(self, group, params)

    def _bind(self, plan: C.Plan) -> Any:
        return sgd_bind(self, plan)

    def _step_group(
        self, plan: C.Plan, grads: list[torch.Tensor], scales: torch.Tensor | None = None
    ) -> None:
        """One SGD update of ``plan.params`` (LARS passes its per-tensor trust ratios as
        ``scales``).

        Params whose momentum buffer exists and those on their first step are two calls, as the
        first step sets the buffer instead of averaging into it; a plan with first-step params is
        used once (the next step rebuilds it, all buffers existing).
        """
        group, device, params = plan.group, plan.device, plan.params
        lr, lr_tensor = C.lr_args(group["lr"], device)
        grad_scale, found_inf = C.amp_args(self, device)
        tail = (
            float(group.get("momentum", 0.0)),
            float(group.get("dampening", 0.0)),
            float(group["weight_decay"]),
            bool(group.get("nesterov", False)),
            bool(group.get("maximize", False)),
        )
        first = plan.lists["first"]
        if not first:
            plan.bound(grads, lr, lr_tensor, *tail, False, scales, grad_scale, found_inf)
            return
        plan.stale = True
        if _skipped(found_inf):
            # Not applied: the new buffers go again, so the next applied step is these params'
            # first.
            for i in first:
                del self.state[params[i]]["momentum_buffer"]
            return
        grads = C.conform_grads(type(self).__name__, plan, grads)
        is_first = set(first)
        rest = [i for i in range(len(params)) if i not in is_first]
        bufs, copy_to = plan.lists["momentum_buffers"], plan.copy_to
        for step_is_first, idx in ((False, rest), (True, first)):
            if not idx:
                continue
            lists = [[t[i] for i in idx] if t else [] for t in (params, grads, bufs, copy_to)]
            sub = None if scales is None else scales[idx]
            args = (*lists, lr, lr_tensor, *tail, step_is_first, sub, grad_scale, found_inf)
            aiak.ops.fused_sgd_(*args)


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


def sgd_bind(opt: C.FusedOptimizer, plan: C.Plan) -> Any:
    """The steady-state step (every momentum buffer exists); None while some param is on its
    first step (that step is split in two calls, ``_step_group``, and the plan is rebuilt
    after it)."""
    if plan.lists["first"]:
        return None
    rest = [plan.lists["momentum_buffers"], plan.copy_to]
    conform = C.conformer(type(opt).__name__, plan)
    return aiak.ops.fused_sgd_.bind(plan.params, rest, conform)


def _skipped(found_inf: torch.Tensor | None) -> bool:
    """GradScaler found inf/NaN (read on the host; never while capturing a CUDA graph)."""
    if found_inf is None:
        return False
    if found_inf.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return bool(found_inf.item() != 0)


# LARS's update: SGD's with its per-tensor trust ratios as ``scales``
sgd_step = FusedSGD._step_group
