"""Activation at interpreter start, for processes with ``AIAK_AUTO=1`` (aiakrun sets it).

:func:`boot` runs from the start-up hook (``_site/sitecustomize.py`` on aiakrun's PYTHONPATH, or
the ``aiak-auto.pth`` an install ships). It imports nothing heavy: it puts a finder on
``sys.meta_path`` that waits for ``import torch`` to finish and only then calls each
subpackage's own ``activate(environ)`` (``aiak.comm.auto``, ``aiak.optim.auto``,
``aiak.amp.auto``); a process that never imports torch never loads aiak. Each subpackage reads
and checks its own variables; a malformed one raises its ``ValueError`` from ``import torch``.
This module is the one place (with the conformance suite) that imports several subpackages,
and only lazily.
"""

from __future__ import annotations

import os
import sys

# Nothing here is imported at start-up beyond os/sys (already loaded): typing, logging and
# importlib load when torch is imported, in activate().
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

__all__ = ["FEATURES", "activate", "boot", "deactivate", "enabled"]

# Each module has activate(environ) -> list[str] (what it switched on) and deactivate().
FEATURES = ("aiak.comm.auto", "aiak.optim.auto", "aiak.amp.auto")

_activated: list[str] = []  # feature modules activated, in order


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("AIAK_AUTO", "").strip() == "1"


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _setup_logging() -> None:
    import logging

    root = logging.getLogger("aiak")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[aiak rank {_rank()}] %(message)s"))
    root.addHandler(handler)
    # Rank 0 tells what is on; the other ranks only warn (a slow rank reports itself).
    root.setLevel(logging.INFO if _rank() == "0" else logging.WARNING)
    root.propagate = False


def activate(environ: Mapping[str, str] | None = None) -> list[str]:
    """Call every subpackage's ``activate``; returns the lines logged (rank 0 logs them)."""
    import importlib
    import logging

    env = dict(os.environ if environ is None else environ)
    _setup_logging()
    logger = logging.getLogger("aiak.launch")
    lines: list[str] = []
    for name in FEATURES:
        if name in _activated:
            continue
        module = importlib.import_module(name)
        done = module.activate(env)
        _activated.append(name)
        lines.extend(done)
    backend = env.get("AIAK_BACKEND", "").strip()
    if backend:
        lines.append(_default_backend(backend))
    for line in filter(None, lines):
        logger.info("%s", line)
    return lines


def deactivate() -> None:
    """Undo every subpackage's activation, last first, and the default backend."""
    while _activated:
        sys.modules[_activated.pop()].deactivate()
    if _saved_init:
        import torch.distributed as dist

        dist.init_process_group = _saved_init.pop()


_saved_init: list = []  # torch.distributed.init_process_group while AIAK_BACKEND fills it


def _default_backend(backend: str) -> str:
    """``init_process_group()`` without a backend uses aiakrun's ``--gloo``/``--nccl``."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"AIAK_BACKEND must be gloo or nccl, got {backend!r}")
    if _saved_init:
        return ""
    orig = dist.init_process_group
    _saved_init.append(orig)

    def init_process_group(backend_: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend_ is None and kwargs.get("backend") is None:
            kwargs.pop("backend", None)
            backend_ = backend
        return orig(backend_, *args, **kwargs)

    init_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    init_process_group.__doc__ = orig.__doc__
    dist.init_process_group = init_process_group
    return f"launch: init_process_group() defaults to {backend}"


class _AfterTorch:
    """One-shot finder: lets the real finders load ``torch``, then activates."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        _remove_finder()
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            activate()

        spec.loader.exec_module = exec_module  # this spec's loader only
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterTorch)]


def boot() -> None:
    """Activate now if torch is loaded, else when it is; nothing without ``AIAK_AUTO=1``."""
    if not enabled():
        return
    if "torch" in sys.modules:
        activate()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
