"""FusedAdam (apex's signature) and FusedAdamW (torch AdamW's signature).

The math is torch.optim.Adam's / AdamW's, state keys and dtypes too (``step`` a float32 tensor
on the param's device as in torch's fused Adam, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), so a state_dict moves between these and their torch twins both ways.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import aiak.ops
from aiak.optim import _common as C

__all__ = ["FusedAdam", "FusedAdamW"]


class FusedAdam(C.FusedOptimizer):
    """Adam / AdamW in one CUDA launch per device (``aiak::fused_adam_``).

    Args follow apex's ``FusedAdam``: ``adam_w_mode=True`` is AdamW (decoupled weight decay,
    torch.optim.AdamW), ``False`` is Adam with L2 decay (torch.optim.Adam);
    ``bias_correction=False`` drops Adam's bias corrections; ``set_grad_none`` is what
    ``zero_grad()`` does. ``maximize`` and ``capturable`` are torch's; ``lr`` may be a tensor
    (on the params' device for ``capturable`` use in CUDA graphs).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        maximize: bool = False,
        capturable: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "adam_w_mode": adam_w_mode,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "capturable": capturable,
        }
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, group: dict, index: int) -> None:
        owner = f"{type(self).__name__} (param_groups[{index}])"
        C.check_nonnegative(
            owner, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"]
        )
        C.check_betas(owner, group["betas"])
        C.check_flags(owner, group, "amsgrad", "maximize", "bias_correction", "adam_w_mode")

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        # A torch Adam/AdamW state_dict says which one it is in `decoupled_weight_decay`.
        if "adam_w_mode" not in group and "decoupled_weight_decay" in group:
            group["adam_w_mode"] = bool(group["decoupled_weight_decay"])
        super()._upgrade_group(group)

    def _plan_key(self, group: dict) -> Any:
        return bool(group["amsgrad"])

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        amsgrad = bool(group["amsgrad"])
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = C.new_step(p)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states.append(st)
        return {
            "exp_avgs": [s["exp_avg"] for s in states],
            "exp_avg_sqs": [s["exp_avg_sq"] for s in states],
            "max_exp_avg_sqs": [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            "state_steps": [s["step"] for s in states],
        }

    def _bind(self, plan: C.Plan) -> Any:
        s = plan.lists
        rest = [s["exp_avgs"], s["exp_avg_sqs"], s["max_exp_avg_sqs"], s["state_steps"]]
        conform = C.conformer(type(self).__name__, plan)
        return aiak.ops.fused_adam_.bind(plan.params, [*rest, plan.copy_to], conform)

    def _step_group(self, plan: C.Plan, grads: list[torch.Tensor]) -> None:
        group, device = plan.group, plan.device
        lr, lr_tensor = C.lr_args(group["lr"], device)
        grad_scale, found_inf = C.amp_args(self, device)
        beta1, beta2 = group["betas"]
        plan.bound(
            grads,
            lr,
            lr_tensor,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            group["adam_w_mode"],
            group["amsgrad"],
            group["maximize"],
            group["bias_correction"],
            grad_scale,
            found_inf,
        )


class FusedAdamW(FusedAdam):
    """torch.optim.AdamW's signature and defaults (``weight_decay=1e-2``), fused.

    ``foreach``, ``fused`` and ``differentiable`` are accepted for drop-in use and ignored
    (``differentiable=True`` is refused: the update is not differentiable).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        del foreach, fused  # always fused: that is the point of this class
        if differentiable:
            raise ValueError("FusedAdamW: differentiable=True is not supported")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=True,
            maximize=maximize,
            capturable=capturable,
            set_grad_none=True,
        )
