"""FusedAdam (apex's signature) and FusedAdamW (torch AdamW's signature).

The math is torch.optim.Adam's / AdamW's, state keys and dtypes too (``step`` a float32 tensor
on the param's device as in torch's fused Adam, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), so a state_dict moves between these and their torch twins both ways.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

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

    def _step_group(self, plan: C.Plan, grads: list[torch.Tensor]) -> None:
        group, device = plan.group, plan.device
        lr, lr_tensor = C.lr_args(group["lr"], device)
        grad_scale, found_inf = C.amp_args(self, device)
        beta1, beta2 = (float(b) for b in group["betas"])
        kw = {
            "lr": lr,
            "lr_tensor": lr_tensor,
            "beta1": beta1,
            "beta2": beta2,
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "adam_w_mode": bool(group["adam_w_mode"]),
            "amsgrad": bool(group["amsgrad"]),
            "maximize": bool(group["maximize"]),
            "bias_correction": bool(group["bias_correction"]),
            "grad_scale": grad_scale,
            "found_inf": found_inf,
        }
        kernel = plan.kernel_dtypes and C.use_ops(device)
        s = plan.lists
        lists = (
            plan.params,
            C.checked_grads(type(self).__name__, plan, grads, kernel),
            s["exp_avgs"],
            s["exp_avg_sqs"],
            s["max_exp_avg_sqs"],
            s["state_steps"],
            plan.copy_to,
        )
        if kernel:
            C.op("fused_adam_")(*lists, *kw.values())
        else:
            adam_foreach(*lists, **kw)


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


def adam_foreach(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    copy_to: Sequence[torch.Tensor],
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    amsgrad: bool,
    maximize: bool,
    bias_correction: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """``aiak::fused_adam_`` with torch._foreach ops, in torch's foreach Adam op order (for
    fp32 params on CPU the result is torch's, bit for bit); fp16/bf16 are computed in fp32."""
    mutated = [*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs, *state_steps, *copy_to]
    if grad_scale is not None:
        mutated += grads

    def update() -> None:
        p, m, v, vmax = (C.upcast(ts) for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
        g = C.upcast(grads)
        if grad_scale is not None:
            # Unscaled grads are written back, as torch's fused optimizers do.
            g = torch._foreach_div(g, grad_scale.reshape(()))
            torch._foreach_copy_(list(grads), g)
        if maximize:
            g = torch._foreach_neg(g)
        rate = lr if lr_tensor is None else lr_tensor.reshape(())
        if lr_tensor is not None and lr_tensor.device.type == "cpu":
            rate = lr_tensor.item()  # a CPU tensor: no device to synchronise
        torch._foreach_add_(state_steps, 1.0)
        if weight_decay != 0:
            if adam_w_mode:
                torch._foreach_mul_(p, 1 - rate * weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        if bias_correction:
            step_size = C.coefficients(state_steps, lambda s: (rate / (1 - beta1**s)) * -1)
            bc2_sqrt = C.coefficients(state_steps, lambda s: (1 - beta2**s) ** 0.5)
        else:
            step_size, bc2_sqrt = [-rate] * len(p), None
        if amsgrad:
            torch._foreach_maximum_(vmax, v)
        denom = torch._foreach_sqrt(vmax if amsgrad else v)
        if bc2_sqrt is not None:
            torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        if isinstance(step_size[0], torch.Tensor):
            upd = torch._foreach_div(m, denom)
            torch._foreach_mul_(upd, step_size)
            torch._foreach_add_(p, upd)
        else:
            torch._foreach_addcdiv_(p, m, denom, step_size)
        for dst, work in ((params, p), (exp_avgs, m), (exp_avg_sqs, v), (max_exp_avg_sqs, vmax)):
            C.store(dst, work)
        C.copy_back(copy_to, params)

    C.unless_found_inf(found_inf, mutated, update)
