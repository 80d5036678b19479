"""The one place aiak.amp touches torch's namespaces: :func:`install` / :func:`uninstall`.

install() adds AIAK-Training's spellings ``torch.cuda.amp.aiak_amp_decorate`` and
``torch.cuda.amp.aiak_amp_parameters`` (and the same under ``torch.amp``), and replaces
``torch.amp.GradScaler.update`` (which ``torch.cuda.amp.GradScaler`` inherits) by one that, for
the optimizers amp decorated, applies the O2 policy around torch's own update. A GradScaler used
only with undecorated optimizers behaves exactly as before. uninstall() restores every
attribute as it found it. Without install(), :class:`GradScaler` gives the same policy.
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.amp import _scaler
from aiak.amp._amp_state import STATES, parameters
from aiak.amp._decorate import decorate

__all__ = ["GradScaler", "install", "installed", "uninstall"]

# Captured at import, before any install(): the update that O2's update wraps.
_TORCH_UPDATE = torch.amp.GradScaler.update
_MISSING = object()
# (owner, attribute) -> what was there before install(); empty when not installed.
_saved: dict[tuple[Any, str], Any] = {}


def _o2_update(scaler: torch.amp.GradScaler, new_scale: float | torch.Tensor | None = None) -> None:
    """torch's update, with the O2 policy of the first decorated optimizer stepped this iteration
    (growth x2 / 2000 clean steps, backoff /2, scale within [min, max], or a static scale)."""
    policy = None
    # A disabled scaler has no per-optimizer state (and its update does nothing).
    for key in getattr(scaler, "_per_optimizer_states", ()):
        state = STATES.get(key)
        if state is not None:
            policy = state.policy
            break
    if policy is None:
        _TORCH_UPDATE(scaler, new_scale)
        return
    _scaler.adopt(scaler, policy)
    _TORCH_UPDATE(scaler, new_scale)
    _scaler.clamp(scaler, policy)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that applies the O2 policy to decorated optimizers without
    install(). Same constructor, with its arguments checked under their names; its
    growth/backoff arguments are overridden for O2."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        where = "aiak.amp.GradScaler"
        if not isinstance(device, str):
            raise TypeError(f"{where}: device must be a str, got {type(device).__name__}")
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"{where}: device {device!r} is not a device type") from None
        if not isinstance(enabled, bool):
            raise TypeError(f"{where}: enabled must be a bool, got {type(enabled).__name__}")
        # The policy's checks, under GradScaler's own argument names.
        _scaler.check_scale(where, "init_scale", init_scale)
        growth = _scaler.check_number(where, "growth_factor", growth_factor)
        if not 1.0 < growth < float("inf"):
            raise ValueError(
                f"{where}: growth_factor must be finite and > 1, got {growth_factor!r}"
            )
        backoff = _scaler.check_number(where, "backoff_factor", backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"{where}: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        _scaler.check_int(where, "growth_interval", growth_interval, 1)
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        _o2_update(self, new_scale)


def _patched_update(self: torch.amp.GradScaler, new_scale: Any = None) -> None:
    _o2_update(self, new_scale)


def _patches() -> list[tuple[Any, str, Any]]:
    return [
        (torch.cuda.amp, "aiak_amp_decorate", decorate),
        (torch.cuda.amp, "aiak_amp_parameters", parameters),
        (torch.amp, "aiak_amp_decorate", decorate),
        (torch.amp, "aiak_amp_parameters", parameters),
        (torch.amp.GradScaler, "update", _patched_update),
    ]


def install() -> None:
    """Attach AIAK-Training's spellings to torch and make every GradScaler O2-aware. Idempotent."""
    if _saved:
        return
    for owner, name, value in _patches():
        # vars(), not getattr(): a class attribute inherited from a base is not ours to restore.
        _saved[(owner, name)] = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)


def uninstall() -> None:
    """Undo :func:`install` exactly. Idempotent."""
    while _saved:
        (owner, name), before = _saved.popitem()
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


def installed() -> bool:
    return bool(_saved)
