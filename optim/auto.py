"""aiak.optim's part of activation without code change (``aiakrun``, ``AIAK_AUTO=1``).

:func:`activate` adds ``torch.optim.LAMB`` (:func:`aiak.optim.install`) and, when
``AIAK_FUSED_OPTIMIZER=1``, makes the construction of a ``torch.optim.Adam``, ``AdamW`` or
``SGD`` return its fused twin (:func:`aiak.optim.fuse`: same groups, hyper-parameters and state
layout, so a torch checkpoint loads into it). The names in ``torch.optim`` are bound to
stand-ins for the time: ``isinstance(opt, torch.optim.AdamW)`` holds for the twin, a user's
subclass of ``torch.optim.AdamW`` is built as written (its own ``step``), and a name imported
before activation keeps torch's class (aiakrun activates when torch finishes importing, before
the user's code runs). :func:`deactivate` rebinds torch's classes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from aiak.optim.adam import FusedAdam, FusedAdamW
from aiak.optim.convert import ENV_VAR, fuse, install, uninstall
from aiak.optim.sgd import FusedSGD

__all__ = ["activate", "active", "check", "deactivate"]

logger = logging.getLogger("aiak.optim")

_NAMES = ("Adam", "AdamW", "SGD")
_saved: dict[str, type] = {}  # torch.optim name -> torch's class, while the swap is on
_state = {"installed": False}
_logged: set[str] = set()


class _Swap(type):
    """Metaclass of the stand-ins bound to ``torch.optim.Adam/AdamW/SGD`` while active."""

    _torch: type
    _stand_in: bool

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not vars(cls).get("_stand_in", False):  # a user's subclass of the stand-in
            return super().__call__(*args, **kwargs)
        twin = fuse(cls._torch(*args, **kwargs))
        name = cls._torch.__name__
        if name not in _logged and os.environ.get("RANK", "0") == "0":
            _logged.add(name)
            logger.info("optim: torch.optim.%s built as aiak %s", name, type(twin).__name__)
        return twin

    def __instancecheck__(cls, obj: Any) -> bool:
        if vars(cls).get("_stand_in", False):
            return isinstance(obj, (cls._torch, *_TWINS[cls._torch.__name__]))
        return super().__instancecheck__(obj)


_TWINS: dict[str, tuple[type, ...]] = {
    "Adam": (FusedAdam,),
    "AdamW": (FusedAdamW,),
    "SGD": (FusedSGD,),
}


def _stand_in(torch_cls: type) -> type:
    return _Swap(
        torch_cls.__name__,
        (torch_cls,),
        {"_torch": torch_cls, "_stand_in": True, "__module__": torch_cls.__module__},
    )


def _wants_fused(env: Mapping[str, str]) -> bool:
    value = (env.get(ENV_VAR) or "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def activate(environ: Mapping[str, str] | None = None, lamb: bool = True) -> list[str]:
    """Install ``torch.optim.LAMB`` (``lamb``) and the fused swap when the env asks for it."""
    env = os.environ if environ is None else environ
    fused = _wants_fused(env)
    done = []
    if lamb and not _state["installed"]:
        install()
        _state["installed"] = True
        done.append("optim: torch.optim.LAMB is aiak's LAMB")
    if fused and not _saved:
        for name in _NAMES:
            _saved[name] = getattr(torch.optim, name)
            setattr(torch.optim, name, _stand_in(_saved[name]))
        done.append(f"optim: {ENV_VAR}=1: torch.optim.Adam/AdamW/SGD are built fused")
    return done


def deactivate() -> None:
    """Undo :func:`activate` exactly. Idempotent."""
    while _saved:
        name, torch_cls = _saved.popitem()
        setattr(torch.optim, name, torch_cls)
    if _state["installed"]:
        uninstall()
        _state["installed"] = False
    _logged.clear()


def active() -> bool:
    return bool(_saved) or _state["installed"]


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` for a malformed ``AIAK_FUSED_OPTIMIZER``."""
    _wants_fused(os.environ if environ is None else environ)
