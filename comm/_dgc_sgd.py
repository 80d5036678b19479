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
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if wd:
                    w = p.mul(wd)
                    if m:
                        st = self.state[p]
                        buf = st.get("momentum_buffer")
                        if buf is None:
                            buf = st["momentum_buffer"] = w.clone()
                        else:
                            buf.mul_(m).add_(w)
                        w = w.add(buf, alpha=m) if group["nesterov"] else buf
                    d = d.add(w)
                p.add_(d, alpha=-lr)
        return loss


def require_sgd(optimizer: Any) -> None:
    name = type(optimizer).__name__
    if isinstance(optimizer, DGCSGD):
        return
    if not (isinstance(optimizer, torch.optim.SGD) or name == "FusedSGD"):
        raise TypeError(
            f"DGC supports SGD only (its momentum lives in the compressor's memory), got {name}"
        )
