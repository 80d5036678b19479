"""DGC's optimizer: SGD with momentum on weight decay only (the gradient's momentum lives in the
hook's memory, aiak.comm.dgc). ``DGCSGD`` and ``check_dgc_optimizer`` are exported from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DGCSGD"]


def _check_group(group: dict[str, Any], op: str) -> None:
    from aiak.ops._args import check_bool, check_float  # lazily: `import aiak.comm` stays lean

    # lr or weight_decay inf (or NaN) turns every parameter to +-inf or NaN in one step
    check_float("lr", group["lr"], ge=0, op=op)
    check_float("momentum", group["momentum"], ge=0, lt=1, op=op)
    check_float("weight_decay", group["weight_decay"], ge=0, op=op)
    check_bool("nesterov", group["nesterov"], op=op)


class DGCSGD(torch.optim.Optimizer):
    """SGD whose momentum applies only to the weight-decay term (gradient momentum is in DGC).

    ``p -= lr * (grad + w)`` with ``w = buf = m*buf + wd*p`` (nesterov: ``wd*p + m*buf``).
    With the hook's dense momentum this is exactly ``torch.optim.SGD(momentum=m, weight_decay=
    wd)`` on the averaged gradient (momentum is linear); with compression it is DGC's rule.
    The state key is ``momentum_buffer`` (the weight-decay buffer).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        _check_group(defaults, "DGCSGD")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, with the group's own settings checked first."""
        if isinstance(param_group, dict):
            _check_group({**self.defaults, **param_group}, "DGCSGD: param group")
        super().add_param_group(param_group)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer) -> DGCSGD:
        """A DGCSGD over ``optimizer``'s groups and settings; SGD (torch or aiak Fused) only."""
        require_sgd(optimizer)
        groups = []
        for g in optimizer.param_groups:
            if g.get("dampening", 0):
                raise ValueError("DGCSGD: dampening is not supported by DGC's momentum")
            if g.get("maximize", False):
                raise ValueError("DGCSGD: maximize=True is not supported")
            groups.append(
                {
                    "params": list(g["params"]),
                    "lr": g["lr"],
                    "momentum": g.get("momentum", 0.0),
                    "weight_decay": g.get("weight_decay", 0.0),
                    "nesterov": g.get("nesterov", False),
                }
            )
        return cls(groups, lr=optimizer.defaults["lr"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # foreach calls per (device, dtype): a constant number of launches per group, where
            # a loop over ResNet-50's 161 tensors costs 161-644 launches and ~2-3 ms of host
            # time a step on an H100 host, all of it on the step's critical path after the last
            # bucket's exchange when the step overlaps the backward
            lists: dict[tuple, tuple[list, list]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    ps, gs = lists.setdefault((p.device, p.dtype, p.grad.dtype), ([], []))
                    ps.append(p)
                    gs.append(p.grad)
            for ps, gs in lists.values():
                self._update(group, ps, gs)
        return loss

    def _update(self, group: dict[str, Any], ps: list, gs: list) -> None:
        """``p -= lr * (g + w)`` for one device and dtype, the ops of the per-tensor rule."""
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        if not wd:
            torch._foreach_add_(ps, gs, alpha=-lr)
            return
        w = torch._foreach_mul(ps, wd)
        if m:
            # a parameter's first step makes its buffer w itself (not m * 0 + w)
            old, old_w = [], []
            for p, wp in zip(ps, w):
                st = self.state[p]
                buf = st.get("momentum_buffer")  # None too in a state saved by torch's SGD
                if buf is not None:
                    old.append(buf)
                    old_w.append(wp)
                else:
                    st["momentum_buffer"] = wp.clone()
            if old:
                torch._foreach_mul_(old, m)
                torch._foreach_add_(old, old_w)
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            w = torch._foreach_add(w, bufs, alpha=m) if group["nesterov"] else bufs
        torch._foreach_add_(ps, torch._foreach_add(gs, w), alpha=-lr)


def require_sgd(optimizer: Any) -> None:
    name = type(optimizer).__name__
    if isinstance(optimizer, DGCSGD):
        return
    if not (isinstance(optimizer, torch.optim.SGD) or name == "FusedSGD"):
        raise TypeError(
            f"DGC supports SGD only (its momentum lives in the compressor's memory), got {name}"
        )
