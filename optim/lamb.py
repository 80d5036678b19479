"""LAMB (You et al., ICLR 2020) with apex FusedLAMB's math: global-norm clipping, Adam moments,
a per-tensor trust ratio. ``FusedLAMB`` has apex's signature and defaults, ``LAMB`` the
seed's (AIAK-Training's ``torch.optim.LAMB``). The math, per step::

    G = ||all grads of all groups||;  clip = G / max_grad_norm if G > max_grad_norm else 1
        (max_grad_norm <= 0: no clipping)
    g' = g / clip  (+ weight_decay * p when adam_w_mode is False: L2 mode)
    m = b1 m + b3 g'  (b3 = 1 - b1 with grad_averaging, else 1);  v = b2 v + (1 - b2) g'^2
    u = (m / bc1) / (sqrt(v / bc2) + eps)  (+ weight_decay * p in adam_w_mode)
    ratio = lr ||p|| / ||u||  if (use_nvlamb or weight_decay != 0) and both norms > 0, else lr
    p -= ratio u

On CUDA: the global norm (``aiak::multi_tensor_l2norm``, all dtypes in one call), then
``aiak::fused_lamb_`` per device: two passes, 44 bytes moved per fp32 param in all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

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
        if float(group["max_grad_norm"]) != float(group["max_grad_norm"]):
            raise ValueError(f"{owner}: max_grad_norm is NaN")

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

    def _step(self, plans: list[tuple[C.Plan, list[torch.Tensor]]]) -> None:
        """One global grad norm over every group (apex's semantics), then the update per group.

        Per step in Python: the grads read once (by ``_plans``), checked once, and reused for
        the norm and the update; everything else comes from the plans. With one device the
        norm op's total is the global norm as it is (no square/stack/sum/sqrt: four small
        launches fewer); with several, per-device norms are combined as before.
        """
        if not plans:
            return
        owner = type(self).__name__
        steps = []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        known: dict[torch.device, bool] = {}
        for plan, grads in plans:
            kernel = plan.kernel_dtypes and C.use_ops(plan.device)
            update_grads = C.checked_grads(owner, plan, grads, kernel)
            steps.append((plan, update_grads, kernel))
            # The norm takes the grads as they are; those that needed no copy have the
            # params' (kernel) dtypes, others are checked by _norm.
            ok = kernel and update_grads is grads
            found = by_device.get(plan.device)
            by_device[plan.device] = grads if found is None else found + grads
            known[plan.device] = ok and known.get(plan.device, True)
        norms = [_norm(grads, device, known[device]) for device, grads in by_device.items()]
        if len(norms) == 1:
            total = norms[0]
        else:
            first = next(iter(by_device))
            sums = [(n**2).to(first, non_blocking=True) for n in norms]
            total = torch.stack(sums).sum().sqrt()
        for plan, update_grads, kernel in steps:
            self._step_group_with_norm(plan, update_grads, kernel, total)

    def _step_group_with_norm(
        self,
        plan: C.Plan,
        grads: list[torch.Tensor],
        kernel: bool,
        grad_norm: torch.Tensor,
    ) -> None:
        group, device, s = plan.group, plan.device, plan.lists
        lr, lr_tensor = C.lr_args(group["lr"], device)
        grad_scale, found_inf = C.amp_args(self, device)
        beta1, beta2 = (float(b) for b in group["betas"])
        lists = (plan.params, grads, s["exp_avgs"], s["exp_avg_sqs"])
        tail = (s["state_steps"], plan.copy_to)
        kw = {
            "grad_norm": grad_norm.to(device, non_blocking=True).reshape(1),
            "lr": lr,
            "lr_tensor": lr_tensor,
            "beta1": beta1,
            "beta2": beta2,
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "bias_correction": bool(group["bias_correction"]),
            "grad_averaging": bool(group["grad_averaging"]),
            "adam_w_mode": bool(group["adam_w_mode"]),
            "use_nvlamb": bool(group["use_nvlamb"]),
            "max_grad_norm": float(group["max_grad_norm"]),
            "grad_scale": grad_scale,
            "found_inf": found_inf,
        }
        if kernel:
            C.op("fused_lamb_")(*lists, self._workspaces(plan), *tail, *kw.values())
        else:
            lamb_foreach(*lists, *tail, **kw)

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
    """The seed's ``LAMB(params, lr=1e-3, weight_decay=0, betas=(0.9, 0.999), eps=1e-8,
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


def _norm(
    tensors: list[torch.Tensor], device: torch.device, kernel_dtypes: bool = False
) -> torch.Tensor:
    """The fp32 L2 norm of all ``tensors`` together, on the device. ``kernel_dtypes``: their
    dtypes are known to be kernel dtypes (else they are checked). The op is called through its
    eager fast path (``C.op``): through the dispatcher the 161-grad list alone cost ~37 µs per
    step on the 2-core EPYC host."""
    if C.use_ops(device) and (kernel_dtypes or C.kernel_dtypes(tensors)):
        return C.op("multi_tensor_l2norm")(tensors, False)[0]
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def lamb_foreach(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    copy_to: Sequence[torch.Tensor],
    *,
    grad_norm: torch.Tensor,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    adam_w_mode: bool,
    use_nvlamb: bool,
    max_grad_norm: float,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """``aiak::fused_lamb_`` with torch._foreach ops (fp32 arithmetic for fp16/bf16 params)."""
    mutated = [*params, *exp_avgs, *exp_avg_sqs, *state_steps, *copy_to]

    def update() -> None:
        p, m, v = (C.upcast(ts) for ts in (params, exp_avgs, exp_avg_sqs))
        scale = 1.0 if grad_scale is None else grad_scale.reshape(())
        norm = grad_norm.reshape(()) / scale
        clip = torch.ones_like(norm)
        if max_grad_norm > 0:
            clip = torch.where(norm > max_grad_norm, norm / max_grad_norm, clip)
        g = torch._foreach_div(C.upcast(grads), clip * scale)
        if not adam_w_mode and weight_decay != 0:
            torch._foreach_add_(g, p, alpha=weight_decay)
        torch._foreach_add_(state_steps, 1.0)
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=1 - beta1 if grad_averaging else 1.0)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        if bias_correction:
            bc1 = C.coefficients(state_steps, lambda s: 1 - beta1**s)
            bc2 = C.coefficients(state_steps, lambda s: 1 - beta2**s)
            u, denom = torch._foreach_div(m, bc1), torch._foreach_div(v, bc2)
        else:
            u, denom = torch._foreach_mul(m, 1.0), torch._foreach_mul(v, 1.0)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(u, denom)
        if adam_w_mode and weight_decay != 0:
            torch._foreach_add_(u, p, alpha=weight_decay)
        rate = lr if lr_tensor is None else lr_tensor.reshape(())
        pn = torch.stack(torch._foreach_norm(p, 2, dtype=torch.float32))
        un = torch.stack(torch._foreach_norm(u, 2, dtype=torch.float32))
        ratio = torch.ones_like(pn) * rate
        if use_nvlamb or weight_decay != 0:
            ratio = torch.where((pn > 0) & (un > 0), rate * (pn / un), ratio)
        torch._foreach_mul_(u, list(ratio.unbind()))
        torch._foreach_sub_(p, u)
        for dst, work in ((params, p), (exp_avgs, m), (exp_avg_sqs, v)):
            C.store(dst, work)
        C.copy_back(copy_to, params)

    C.unless_found_inf(found_inf, mutated, update)
