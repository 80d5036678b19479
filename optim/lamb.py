"""LAMB (You et al., ICLR 2020) with apex FusedLAMB's math: global-norm clipping, Adam moments,
a per-tensor trust ratio. ``FusedLAMB`` has apex's signature and defaults, ``LAMB``
AIAK-Training's (its ``torch.optim.LAMB``). The math is the op's (``aiak::fused_lamb_``,
ops/fused_lamb.py); per step: the grad norm over every group on each device
(``aiak::multi_tensor_l2norm``, all dtypes in one call), then ``fused_lamb_`` per group, which
combines the devices' norms into the global one.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

import aiak.ops
from aiak.ops.multi_tensor_l2norm import BoundNorm
from aiak.optim import _common as C

__all__ = ["LAMB", "FusedLAMB"]


class FusedLAMB(C.FusedOptimizer):
    """apex's ``FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
    weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
    set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False)``. State: ``step``, ``exp_avg``,
    ``exp_avg_sq`` (as Adam's). ``amsgrad=True`` is refused, as apex does."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(f"{type(self).__name__}: amsgrad is not supported by LAMB")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
            "use_nvlamb": use_nvlamb,
        }
        super().__init__(params, defaults, set_grad_none)
        # fp32 update workspaces (stage 1 -> stage 2 of the kernel), kept between steps so the
        # kernels' pointer tables stay valid; not state: nothing to save.
        self._updates: dict[torch.Tensor, torch.Tensor] = {}

    def _check_group(self, group: dict, index: int) -> None:
        owner = f"{type(self).__name__} (param_groups[{index}])"
        C.check_nonnegative(
            owner, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"]
        )
        C.check_betas(owner, group["betas"])
        if C.number(owner, "max_grad_norm", group["max_grad_norm"]) != group["max_grad_norm"]:
            raise ValueError(f"{owner}: max_grad_norm is NaN")
        C.check_flags(owner, group, "bias_correction", "adam_w_mode", "grad_averaging")
        C.check_flags(owner, group, "use_nvlamb")

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = C.new_step(p)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states.append(st)
        return {
            "exp_avgs": [s["exp_avg"] for s in states],
            "exp_avg_sqs": [s["exp_avg_sq"] for s in states],
            "state_steps": [s["step"] for s in states],
        }

    def _bind(self, plan: C.Plan) -> Any:
        s = plan.lists
        rest = [s["exp_avgs"], s["exp_avg_sqs"], self._workspaces(plan), s["state_steps"]]
        conform = C.conformer(type(self).__name__, plan)
        return aiak.ops.fused_lamb_.bind(plan.params, [*rest, plan.copy_to], conform)

    def _before_groups(self, plans: list[tuple[C.Plan, list[torch.Tensor]]]) -> None:
        """The global grad norm over every group (apex's semantics), in parts: one L2 norm of
        the grads per device (``fused_lamb_`` combines them), each through a ``BoundNorm``
        kept while that device's plans (so the parameter lists) stay the same objects."""
        by_device: dict[torch.device, tuple[list[C.Plan], list[torch.Tensor]]] = {}
        for plan, grads in plans:
            found = by_device.get(plan.device)
            by_device[plan.device] = (
                ([plan], grads) if found is None else ([*found[0], plan], found[1] + grads)
            )
        kept = self.__dict__.setdefault("_norms", {})
        norms = []
        for device, (mine, grads) in by_device.items():
            found = kept.get(device)
            if (
                found is None
                or len(found[0]) != len(mine)
                or any(map(operator.is_not, found[0], mine))
            ):
                found = kept[device] = (mine, BoundNorm())
            norms.append(found[1](grads))
        self.__dict__["_aiak_grad_norms"] = norms

    def _step_group(self, plan: C.Plan, grads: list[torch.Tensor]) -> None:
        group, device = plan.group, plan.device
        lr, lr_tensor = C.lr_args(group["lr"], device)
        grad_scale, found_inf = C.amp_args(self, device)
        beta1, beta2 = group["betas"]
        plan.bound(
            grads,
            self.__dict__["_aiak_grad_norms"],
            lr,
            lr_tensor,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            group["bias_correction"],
            group["grad_averaging"],
            group["adam_w_mode"],
            group["use_nvlamb"],
            float(group["max_grad_norm"]),
            grad_scale,
            found_inf,
        )

    def _workspaces(self, plan: C.Plan) -> list[torch.Tensor]:
        """The plan's fp32 update workspaces, one per param: made once per param (kept in
        ``self._updates`` across plan rebuilds, so the kernels' pointer tables stay valid)."""
        found = plan.extra.get("updates")
        if found is None:
            updates = self.__dict__.setdefault("_updates", {})
            found = []
            for p in plan.params:
                u = updates.get(p)
                if u is None:
                    u = torch.empty_like(
                        p, dtype=torch.float32, memory_format=torch.preserve_format
                    )
                    updates[p] = u
                found.append(u)
            plan.extra["updates"] = found
        return found


class LAMB(FusedLAMB):
    """AIAK-Training's ``LAMB(params, lr=1e-3, weight_decay=0, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0)``; same math
    as :class:`FusedLAMB` (and the same kernels)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        *,
        bias_correction: bool = True,
        use_nvlamb: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            set_grad_none=set_grad_none,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
        )
