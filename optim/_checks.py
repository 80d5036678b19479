"""The optimizers' input checks: hyper-parameters (numbers, ranges, flags), params, grads.
Each raises TypeError/ValueError naming the argument (and its param group)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from aiak.optim._common import Plan

_layout = operator.attrgetter("layout")


def number(owner: str, name: str, value: Any, tensor_ok: bool = False) -> float:
    """``value`` as a float: a real number (not a bool or a string), or for ``tensor_ok`` (lr) a
    one-element floating-point tensor, read once here at construction (no step-time sync)."""
    if isinstance(value, torch.Tensor) and tensor_ok:
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"{owner}: {name} must be a float or a one-element float tensor")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a float, got {type(value).__name__}")
    return float(value)


def check_nonnegative(owner: str, **values: Any) -> None:
    """Finite numbers >= 0 (``lr`` may be a tensor)."""
    for name, value in values.items():
        v = number(owner, name, value, tensor_ok=name == "lr")
        if not 0.0 <= v < float("inf"):  # also rejects NaN
            raise ValueError(f"{owner}: {name} must be >= 0 and finite, got {v}")


def check_betas(owner: str, betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= number(owner, f"betas[{i}]", b) < 1.0:
            raise ValueError(f"{owner}: betas[{i}] must be in [0, 1), got {float(b)}")


def check_flags(owner: str, group: dict, *names: str) -> None:
    for name in names:
        if not isinstance(group[name], bool):
            raise TypeError(f"{owner}: {name} must be a bool, got {type(group[name]).__name__}")


def check_params(owner: str, group: dict, index: int) -> None:
    """Floating-point params, all on one device (the kernels take one device per launch)."""
    devices = []
    for i, p in enumerate(group["params"]):
        if not p.is_floating_point():
            raise TypeError(
                f"{owner}: param_groups[{index}]['params'][{i}] has dtype {p.dtype}; "
                "only floating-point parameters can be optimized"
            )
        if p.device not in devices:
            devices.append(p.device)
    if len(devices) > 1:
        names = ", ".join(map(str, devices))
        raise ValueError(
            f"{owner}: param_groups[{index}] has params on several devices ({names}); "
            "put the params of each device in a group of their own"
        )


def check_dense_grads(
    owner: str, plan: Plan, grads: Sequence[torch.Tensor], which: Sequence[int] | None = None
) -> None:
    """Refuse sparse grads, naming the param's index in its group. ``grads``: those of
    ``plan.params``, or of ``plan.params[i] for i in which``."""
    if grads and set(map(_layout, grads)) != {torch.strided}:
        positions = [i for i, has in enumerate(plan.mask) if has]
        j = next(j for j, g in enumerate(grads) if g.layout != torch.strided)
        index = positions[j if which is None else which[j]]
        raise TypeError(
            f"{owner}: params[{index}] has a sparse grad; fused optimizers take dense grads only"
        )
