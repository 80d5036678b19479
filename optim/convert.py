"""Turning torch optimizers into their fused twins, and the one explicit torch patch.

- :func:`fuse` takes a torch ``Adam``/``AdamW``/``SGD`` and returns its aiak twin with the same
  param groups, hyper-parameters and state (so training goes on on the same trajectory).
- :func:`from_env` does it when ``AIAK_FUSED_OPTIMIZER=1`` (AIAK-Training's variable).
- :func:`install` adds ``torch.optim.LAMB`` (AIAK-Training's spelling); :func:`uninstall`
  removes it.
"""

from __future__ import annotations

import os

import torch

from aiak.optim.adam import FusedAdam, FusedAdamW
from aiak.optim.lamb import LAMB
from aiak.optim.sgd import FusedSGD

__all__ = ["from_env", "fuse", "install", "uninstall"]

ENV_VAR = "AIAK_FUSED_OPTIMIZER"
_SENTINEL = object()
_saved_lamb: object = _SENTINEL  # what torch.optim.LAMB was before install()
# torch's classes as imported: aiak.optim.auto may rebind the torch.optim names later.
_ADAM, _ADAMW, _SGD = torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD


def fuse(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The fused twin of a torch ``Adam``, ``AdamW`` or ``SGD``: same groups (hyper-parameters
    included) and state. An aiak optimizer is returned as it is; any other type is a TypeError.
    """
    if isinstance(optimizer, (FusedAdam, FusedSGD)):
        return optimizer
    if type(optimizer) is _ADAMW:
        twin: torch.optim.Optimizer = FusedAdamW([torch.zeros(0)])
    elif type(optimizer) is _ADAM:
        twin = FusedAdam([torch.zeros(0)], adam_w_mode=False)
    elif type(optimizer) is _SGD:
        twin = FusedSGD([torch.zeros(0)])
    else:
        raise TypeError(
            "fuse: optimizer must be torch.optim.Adam, AdamW or SGD, "
            f"got {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError("fuse: a differentiable optimizer has no fused twin")
    # Build the twin on the real groups, then load the state (steps move to the param device).
    twin.param_groups = []
    twin.state.clear()
    for group in optimizer.param_groups:
        twin.add_param_group(dict(group))
    twin.load_state_dict(optimizer.state_dict())
    return twin


def from_env(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``fuse(optimizer)`` when ``AIAK_FUSED_OPTIMIZER=1``, the optimizer itself when it is 0 or
    unset; any other value is a ValueError (a typo must not silently mean 'off')."""
    value = os.environ.get(ENV_VAR, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return fuse(optimizer) if value == "1" else optimizer


def install() -> None:
    """Add ``torch.optim.LAMB`` (aiak's :class:`LAMB`). Reversible with :func:`uninstall`."""
    global _saved_lamb
    if _saved_lamb is _SENTINEL:
        _saved_lamb = getattr(torch.optim, "LAMB", None)
    torch.optim.LAMB = LAMB


def uninstall() -> None:
    """Undo :func:`install`: ``torch.optim.LAMB`` is what it was before (absent, usually)."""
    global _saved_lamb
    if _saved_lamb is _SENTINEL:
        return
    if _saved_lamb is None:
        if hasattr(torch.optim, "LAMB"):
            del torch.optim.LAMB
    else:
        torch.optim.LAMB = _saved_lamb
    _saved_lamb = _SENTINEL
