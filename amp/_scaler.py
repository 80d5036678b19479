"""O2 loss scaling: the policy (one frozen dataclass) and a device-side scaler per loss.

Apex O2's dynamic policy: start at 2^16 (never above ``max_scale``), halve on overflow, double
after 2000 clean steps, stay within [min_scale, max_scale]. A number for ``loss_scale`` makes
the scale static. The same policy drives both :class:`LossScaler` (``scale_loss``, one per loss)
and a native ``torch.amp.GradScaler`` (:func:`adopt` before its update, :func:`clamp` after).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "LossScalePolicy",
    "LossScaler",
    "adopt",
    "check_int",
    "check_number",
    "check_scale",
    "clamp",
]


def check_number(where: str, name: str, value: Any) -> float:
    """``value`` as a float when it is a real number (not a bool), else a TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}") from None


# Scales live in fp32 tensors: a scale must be a positive normal fp32 number.
FP32_TINY = torch.finfo(torch.float32).tiny
FP32_MAX = torch.finfo(torch.float32).max


def check_scale(where: str, name: str, value: Any) -> float:
    """``value`` as a float when it is a loss scale (a positive normal fp32 number), else
    named errors."""
    x = check_number(where, name, value)
    if not FP32_TINY <= x <= FP32_MAX:  # also refuses nan and inf
        raise ValueError(
            f"{where}: {name} must be a finite number > 0 within fp32's normal range "
            f"({FP32_TINY:.3g}..{FP32_MAX:.3g}), got {value!r}"
        )
    return x


# Growth trackers are int32 tensors (torch's GradScaler keeps them so too).
INT32_MAX = 2**31 - 1


def check_int(where: str, name: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> int:
    """``value`` when it is an int (not a bool) in ``[minimum, maximum]``, else named errors."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{where}: {name} must be in {minimum}..{maximum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LossScalePolicy:
    """How a loss scale moves. ``static`` scales never move; dynamic ones follow apex O2."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None  # None: no floor (apex's default)
    max_scale: float = 2.0**24
    static: bool = False

    def __post_init__(self) -> None:
        where = "LossScalePolicy"
        check_scale(where, "init_scale", self.init_scale)
        check_scale(where, "max_scale", self.max_scale)
        if self.min_scale is not None:
            check_scale(where, "min_scale", self.min_scale)
            if self.min_scale > self.max_scale:
                raise ValueError(
                    f"{where}: min_scale must be <= max_scale, got min_scale="
                    f"{self.min_scale!r} and max_scale={self.max_scale!r}"
                )
        check_number(where, "growth_factor", self.growth_factor)
        if not 1.0 <= self.growth_factor < math.inf:
            raise ValueError(
                f"{where}: growth_factor must be finite and >= 1, got {self.growth_factor!r}"
            )
        check_number(where, "backoff_factor", self.backoff_factor)
        if not 0.0 < self.backoff_factor <= 1.0:
            raise ValueError(
                f"{where}: backoff_factor must be in (0, 1], got {self.backoff_factor!r}"
            )
        check_int(where, "growth_interval", self.growth_interval, 1)
        if not isinstance(self.static, bool):
            raise TypeError(f"{where}: static must be a bool, got {type(self.static).__name__}")

    @classmethod
    def o2(
        cls,
        loss_scale: float | str | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> LossScalePolicy:
        """The policy ``decorate(loss_scale=..., min_loss_scale=..., max_loss_scale=...)`` means.

        Each argument is checked under its own name, before the policy is built.
        """
        where = "aiak.amp.decorate"
        max_scale = check_scale(where, "max_loss_scale", max_loss_scale)
        min_scale = None
        if min_loss_scale is not None:
            min_scale = check_scale(where, "min_loss_scale", min_loss_scale)
            if min_scale > max_scale:
                raise ValueError(
                    f"{where}: min_loss_scale must be <= max_loss_scale, got "
                    f"{min_loss_scale!r} > {max_loss_scale!r}"
                )
        if loss_scale is None or (isinstance(loss_scale, str) and loss_scale == "dynamic"):
            # apex: dynamic scaling starts at min(2^16, max_loss_scale).
            return cls(init_scale=min(2.0**16, max_scale), min_scale=min_scale, max_scale=max_scale)
        if isinstance(loss_scale, str):
            raise ValueError(
                f"{where}: loss_scale must be None, 'dynamic' or a number, got {loss_scale!r}"
            )
        scale = check_scale(where, "loss_scale", loss_scale)
        return cls(init_scale=scale, max_scale=max(scale, max_scale), static=True)

    def clamp_bounds(self) -> dict[str, float]:
        """``Tensor.clamp_`` keyword arguments that keep a scale inside the policy's range."""
        # Without a floor a scale still stays a normal fp32 number: a zero scale would zero
        # every gradient from then on.
        floor = FP32_TINY if self.min_scale is None else float(self.min_scale)
        return {"min": floor, "max": float(self.max_scale)}


class LossScaler:
    """One loss's scale and growth tracker, kept on the device: updating never syncs the host."""

    __slots__ = ("_growth_tracker", "_init_scale", "_init_tracker", "_scale", "policy")

    def __init__(self, policy: LossScalePolicy) -> None:
        if not isinstance(policy, LossScalePolicy):
            raise TypeError(
                f"LossScaler: policy must be a LossScalePolicy, got {type(policy).__name__}"
            )
        self.policy = policy
        self._init_scale = float(policy.init_scale)
        self._init_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None

    def scale(self, device: torch.device) -> torch.Tensor:
        """The current scale as a one-element fp32 tensor on ``device`` (created lazily)."""
        if self._scale is None:
            # 0-dim, as GradScaler's: ``loss * scale`` keeps the loss's shape.
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full(
                (), self._init_tracker, dtype=torch.int32, device=device
            )
        elif self._scale.device != device:
            return self._scale.to(device)
        return self._scale

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        # In double, as GradScaler does, so 1/scale is exact for powers of two and close otherwise.
        return self.scale(device).double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off on overflow (``found_inf`` > 0); grow after ``growth_interval`` clean ones."""
        if self.policy.static or self._scale is None:
            return
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf.to(self._scale.device),
            self.policy.growth_factor,
            self.policy.backoff_factor,
            self.policy.growth_interval,
        )
        self._scale.clamp_(**self.policy.clamp_bounds())

    def get_scale(self) -> float:
        """The current scale as a Python float (synchronises the host)."""
        return self._init_scale if self._scale is None else float(self._scale.item())

    def state_dict(self) -> dict[str, Any]:
        tracker = self._growth_tracker
        return {
            "scale": self.get_scale(),
            "growth_tracker": self._init_tracker if tracker is None else int(tracker.item()),
        }

    @staticmethod
    def check_state_dict(state: Any, where: str = "LossScaler.load_state_dict") -> None:
        """Refuse what :meth:`state_dict` cannot have made, naming the entry."""
        if not isinstance(state, dict) or not {"scale", "growth_tracker"} <= state.keys():
            raise TypeError(
                f"{where}: a loss scaler's state must be a dict with 'scale' and "
                f"'growth_tracker', got {state!r}"
            )
        check_scale(where, "state_dict 'scale'", state["scale"])
        check_int(where, "state_dict 'growth_tracker'", state["growth_tracker"], 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self._init_scale = float(state["scale"])
        self._init_tracker = int(state["growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_tracker)


def adopt(scaler: torch.amp.GradScaler, policy: LossScalePolicy) -> None:
    """Make a native GradScaler's next ``update`` follow ``policy`` whatever it was built with:
    for decorated optimizers the O2 policy rules, and growth/backoff arguments given to the
    GradScaler do not take effect (AIAK-Training's documented behaviour). Call right before its
    update."""
    scaler._growth_factor = 1.0 if policy.static else policy.growth_factor
    scaler._backoff_factor = 1.0 if policy.static else policy.backoff_factor
    scaler._growth_interval = policy.growth_interval


def clamp(scaler: torch.amp.GradScaler, policy: LossScalePolicy) -> None:
    """After a native GradScaler's update: a static scale is reset, a dynamic one clamped."""
    scale = scaler._scale
    if scale is None:  # disabled, or never used
        return
    if policy.static:
        scale.fill_(policy.init_scale)
    else:
        scale.clamp_(**policy.clamp_bounds())
