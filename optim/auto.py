"""aiak.optim's part of activation without code change (``aiakrun``, ``AIAK_AUTO=1``).

:func:`activate` adds ``torch.optim.LAMB`` (:func:`aiak.optim.install`). With
``AIAK_FUSED_OPTIMIZER=1``, :func:`optimizer_builders` tells the launcher's start-up hook
(``aiak.launch._boot``, the one place that swaps torch's optimizer classes) to build a
``torch.optim.Adam``, ``AdamW`` or ``SGD`` as its fused twin (:func:`aiak.optim.fuse`: same
groups, hyper-parameters and state layout, so a torch checkpoint loads into it;
``isinstance(opt, torch.optim.AdamW)`` holds for the twin). :func:`deactivate` removes LAMB.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from aiak.optim.adam import FusedAdam, FusedAdamW
from aiak.optim.convert import ENV_VAR, fuse, install, uninstall
from aiak.optim.sgd import FusedSGD

__all__ = ["activate", "active", "check", "deactivate", "optimizer_builders"]

_state = {"installed": False}
_TWINS: dict[str, tuple[type, ...]] = {
    "Adam": (FusedAdam,),
    "AdamW": (FusedAdamW,),
    "SGD": (FusedSGD,),
}


def _wants_fused(env: Mapping[str, str]) -> bool:
    value = (env.get(ENV_VAR) or "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def optimizer_builders(
    environ: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, Callable[[torch.optim.Optimizer], torch.optim.Optimizer], tuple]]:
    """``torch.optim`` name -> (the variable, builder of the twin from torch's optimizer, the
    twin's classes): what ``AIAK_FUSED_OPTIMIZER=1`` asks the start-up hook to swap."""
    env = os.environ if environ is None else environ
    if not _wants_fused(env):
        return {}
    return {name: (ENV_VAR, fuse, twins) for name, twins in _TWINS.items()}


def activate(environ: Mapping[str, str] | None = None, lamb: bool = True) -> list[str]:
    """Install ``torch.optim.LAMB`` (``lamb``); say what the fused swap will do."""
    env = os.environ if environ is None else environ
    done = []
    if lamb and not _state["installed"]:
        install()
        _state["installed"] = True
        done.append("optim: torch.optim.LAMB is aiak's LAMB")
    if _wants_fused(env):
        done.append(f"optim: {ENV_VAR}=1: torch.optim.Adam/AdamW/SGD are built fused")
    return done


def deactivate() -> None:
    """Undo :func:`activate` exactly. Idempotent."""
    if _state["installed"]:
        uninstall()
        _state["installed"] = False


def active() -> bool:
    return _state["installed"]


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` for a malformed ``AIAK_FUSED_OPTIMIZER``."""
    _wants_fused(os.environ if environ is None else environ)
