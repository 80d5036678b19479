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

__all__ = ["LossScalePolicy", "LossScaler", "adopt", "clamp"]


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
        for name in ("init_scale", "max_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"LossScalePolicy: {name} must be a finite number > 0, got {value!r}"
                )
        if self.min_scale is not None and not (0 < self.min_scale <= self.max_scale):
            raise ValueError(
                "LossScalePolicy: need 0 < min_scale <= max_scale, got "
                f"min_scale={self.min_scale!r} and max_scale={self.max_scale!r}"
            )
        if not self.growth_factor >= 1.0 or not 0.0 < self.backoff_factor <= 1.0:
            raise ValueError(
                "LossScalePolicy: need growth_factor >= 1 and 0 < backoff_factor <= 1, got "
                f"{self.growth_factor!r} and {self.backoff_factor!r}"
            )
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(
                "LossScalePolicy: growth_interval must be an int >= 1, got "
                f"{self.growth_interval!r}"
            )

    @classmethod
    def o2(
        cls,
        loss_scale: float | str | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> LossScalePolicy:
        """The policy ``decorate(loss_scale=..., min_loss_scale=..., max_loss_scale=...)`` means."""
        if loss_scale is None or loss_scale == "dynamic":
            # apex: dynamic scaling starts at min(2^16, max_loss_scale).
            return cls(
                init_scale=min(2.0**16, float(max_loss_scale)),
                min_scale=None if min_loss_scale is None else float(min_loss_scale),
                max_scale=float(max_loss_scale),
            )
        if isinstance(loss_scale, (str, bool)):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a number, got {loss_scale!r}")
        scale = float(loss_scale)
        return cls(init_scale=scale, max_scale=max(scale, float(max_loss_scale)), static=True)

    def clamp_bounds(self) -> dict[str, float]:
        """``Tensor.clamp_`` keyword arguments that keep a scale inside the policy's range."""
        bounds = {"max": self.max_scale}
        if self.min_scale is not None:
            bounds["min"] = self.min_scale
        return bounds


class LossScaler:
    """One loss's scale and growth tracker, kept on the device: updating never syncs the host."""

    __slots__ = ("_growth_tracker", "_init_scale", "_init_tracker", "_scale", "policy")

    def __init__(self, policy: LossScalePolicy) -> None:
        self.policy = policy
        self._init_scale = policy.init_scale
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._init_scale = float(state["scale"])
        self._init_tracker = int(state["growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_tracker)


def adopt(scaler: torch.amp.GradScaler, policy: LossScalePolicy) -> None:
    """Make a native GradScaler's next ``update`` follow ``policy`` whatever it was built with
    (the seed: "manual changes do not take effect"). Call right before its update."""
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
