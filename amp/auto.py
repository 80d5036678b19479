"""aiak.amp's part of activation without code change (``aiakrun``, ``AIAK_AUTO=1``).

:func:`activate` runs :func:`aiak.amp.install`: ``torch.cuda.amp.aiak_amp_decorate`` /
``aiak_amp_parameters`` exist and GradScalers follow the O2 policy for decorated optimizers (an
undecorated optimizer's GradScaler behaves exactly as before). :func:`deactivate` undoes it.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiak.amp._install import install, installed, uninstall

__all__ = ["activate", "active", "deactivate"]

_state = {"ours": False}


def activate(environ: Mapping[str, str] | None = None) -> list[str]:
    """Install amp's spellings on torch (amp reads no variable of its own)."""
    del environ
    if installed():
        return []
    install()
    _state["ours"] = True
    return ["amp: torch.cuda.amp.aiak_amp_decorate / aiak_amp_parameters exist"]


def deactivate() -> None:
    """Undo :func:`activate` (only an install it made). Idempotent."""
    if _state["ours"]:
        uninstall()
        _state["ours"] = False


def active() -> bool:
    return _state["ours"]
