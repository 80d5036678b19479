"""LARS (You, Gitman & Ginsburg 2017): SGD with momentum and a per-layer trust ratio.

Per tensor, with d = g + weight_decay * p::

    trust = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
            (1 when ||p|| == 0 or ||g|| == 0, and for excluded tensors)
    buf = momentum * buf + trust * d      (buf = trust * d on the first step)
    p  -= lr * buf

1-D tensors (biases, norm scales) are excluded from the adaptation by default
(``exclude_1d=True``); weight decay still applies to them unless their group sets it to 0.
The norms are taken on the device (``aiak::multi_tensor_l2norm``) and the update is
``aiak::fused_sgd_`` with the ratios as per-tensor scales: no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import aiak.ops
from aiak.optim import _common as C
from aiak.optim.sgd import sgd_bind, sgd_plan_key, sgd_plan_lists, sgd_step

__all__ = ["LARS"]


class LARS(C.FusedOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_1d: bool = True,
        *,
        set_grad_none: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "exclude_1d": exclude_1d,
        }
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, group: dict, index: int) -> None:
        owner = f"{type(self).__name__} (param_groups[{index}])"
        C.check_nonnegative(
            owner,
            lr=group["lr"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
            trust_coefficient=group["trust_coefficient"],
            eps=group["eps"],
        )
        C.check_flags(owner, group, "exclude_1d")

    def _plan_key(self, group: dict) -> Any:
        return sgd_plan_key(group)

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        return sgd_plan_lists(self, group, params)

    def _bind(self, plan: C.Plan) -> Any:
        return sgd_bind(self, plan)

    def _step_group(self, plan: C.Plan, grads: list[torch.Tensor]) -> None:
        group, params = plan.group, plan.params
        grad_scale, _ = C.amp_args(self, plan.device)
        # The norms are of the grads as they are (sparse ones are refused first).
        C.check_dense_grads(type(self).__name__, plan, grads)
        _, per = aiak.ops.multi_tensor_l2norm(params + grads, True)
        n = len(params)
        pn, gn = per[:n], per[n:]
        if grad_scale is not None:
            gn = gn / grad_scale  # norms of the still-scaled grads
        wd, tc, eps = (float(group[k]) for k in ("weight_decay", "trust_coefficient", "eps"))
        trust = tc * pn / (gn + wd * pn + eps)
        adapt = (pn > 0) & (gn > 0)
        if group["exclude_1d"]:
            adapt &= self._adapted(plan)
        scales = torch.where(adapt, trust, torch.ones_like(trust)).float()
        sgd_step(self, plan, grads, scales=scales)

    def _adapted(self, plan: C.Plan) -> torch.Tensor:
        """Which params get a trust ratio (dim > 1), as a device mask: one upload per param
        set, then nothing crosses to the device (the upload synchronises). Kept per param set
        (not only per plan: SGD's first step rebuilds the plan on the second) and with the
        plan, so the steady state does no per-tensor work for it."""
        mask = plan.extra.get("adapted")
        if mask is None:
            key = tuple(map(id, plan.params))
            masks = self.__dict__.setdefault("_masks", {})
            mask = masks.get(key)
            if mask is None:
                mask = torch.tensor([p.dim() > 1 for p in plan.params]).to(plan.device)
                masks[key] = mask
            plan.extra["adapted"] = mask
        return mask
