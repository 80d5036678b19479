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
    from collections.abc import Callable, Mapping
    from typing import Any

__all__ = ["FEATURES", "activate", "boot", "deactivate", "enabled"]

# Each module has activate(environ) -> list[str] (what it switched on) and deactivate().
FEATURES = ("aiak.comm.auto", "aiak.optim.auto", "aiak.amp.auto")

_activated: list[str] = []  # feature modules activated, in order
_started_by_activated: list[bool] = []  # set by boot(): see _descendant()


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("AIAK_AUTO", "").strip() == "1"


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _descendant() -> bool:
    """Whether an activated process started this one (DataLoader or compile workers, a
    script's subprocess): those activate too, quietly, so start-up lines print once per rank.
    The mark is the activated process's pid in the environment its children inherit."""
    parent = os.environ.get("AIAK_BOOTED_PID")
    os.environ["AIAK_BOOTED_PID"] = str(os.getpid())
    return parent not in (None, str(os.getpid()))


def _setup_logging() -> None:
    import logging

    root = logging.getLogger("aiak")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[aiak rank {_rank()}] %(message)s"))
    root.addHandler(handler)
    # Rank 0 tells what is on; the other ranks and their child processes only warn.
    quiet = any(_started_by_activated) or _rank() != "0"
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    root.propagate = False


def activate(environ: Mapping[str, str] | None = None) -> list[str]:
    """Call every subpackage's ``activate``; returns the lines logged (rank 0 logs them)."""
    import importlib
    import logging

    env = dict(os.environ if environ is None else environ)
    _setup_logging()
    logger = logging.getLogger("aiak.launch")
    lines: list[str] = []
    builders: dict[str, tuple[str, str, Any, tuple[type, ...]]] = {}
    for name in FEATURES:
        if name in _activated:
            continue
        module = importlib.import_module(name)
        wanted = module.optimizer_builders(env) if hasattr(module, "optimizer_builders") else {}
        for torch_name, builder in wanted.items():
            if torch_name in builders:
                raise ValueError(
                    f"{builders[torch_name][1]} and {builder[0]} both build torch.optim."
                    f"{torch_name}: switch one of the two off"
                )
            builders[torch_name] = (name.split(".")[1], *builder)
    for name in FEATURES:
        if name in _activated:
            continue
        module = importlib.import_module(name)
        done = module.activate(env)
        _activated.append(name)
        lines.extend(done)
    _swap_optimizers(builders)
    lines.append(_wrap_init(env))
    _record_errors(env)
    for line in filter(None, lines):
        logger.info("%s", line)
    return lines


def deactivate() -> None:
    """Undo every subpackage's activation, last first, and the launcher's own wraps."""
    _restore_optimizers()
    while _activated:
        sys.modules[_activated.pop()].deactivate()
    if "init" in _saved:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.init_process_group = c10d.init_process_group = _saved.pop("init")
    if "excepthook" in _saved:
        sys.excepthook = _saved.pop("excepthook")


_saved: dict[str, Any] = {}  # what the launcher's wraps replaced, while they are on
_torch_optimizers: dict[str, type] = {}  # torch.optim name -> torch's class, while swapped


class _Swap(type):
    """Metaclass of the stand-ins bound to ``torch.optim.<name>`` while a feature builds that
    optimizer its own way (``AIAK_FUSED_OPTIMIZER``: the fused twin; ``AIAK_DGC``: DGCSGD).

    The one swap of torch's optimizer classes: constructing the stand-in builds torch's
    optimizer as written, then hands it to the feature's builder; ``isinstance(opt,
    torch.optim.SGD)`` holds for what the builder returns; a user's subclass of the stand-in is
    built as written (its own ``step``); a name imported before activation keeps torch's class
    (activation runs when torch finishes importing, before the user's code)."""

    _torch: type
    _build: Any
    _products: tuple[type, ...]
    _feature: str
    _said: bool

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not vars(cls).get("_stand_in", False):  # a user's subclass of the stand-in
            return super().__call__(*args, **kwargs)
        built = cls._build(cls._torch(*args, **kwargs))
        if not cls._said:
            import logging

            cls._said = True  # once per name
            logging.getLogger("aiak.launch").info(
                "%s: torch.optim.%s built as aiak %s",
                cls._feature,
                cls._torch.__name__,
                type(built).__name__,
            )
        return built

    def __instancecheck__(cls, obj: Any) -> bool:
        if vars(cls).get("_stand_in", False):
            return isinstance(obj, (cls._torch, *cls._products))
        return super().__instancecheck__(obj)


def _swap_optimizers(builders: Mapping[str, tuple[str, str, Any, tuple[type, ...]]]) -> None:
    """Bind each named ``torch.optim`` class to a stand-in that builds it through its feature's
    builder: ``name -> (feature, variable, build(torch_optimizer) -> optimizer, the classes it
    builds)``."""
    import torch

    for name, (feature, _variable, build, products) in builders.items():
        if name in _torch_optimizers:
            continue
        torch_cls = getattr(torch.optim, name)
        _torch_optimizers[name] = torch_cls
        stand_in = _Swap(
            name,
            (torch_cls,),
            {
                "_torch": torch_cls,
                "_stand_in": True,
                "_build": staticmethod(build),
                "_products": products,
                "_feature": feature,
                "_said": False,
                "__module__": torch_cls.__module__,
            },
        )
        setattr(torch.optim, name, stand_in)


def _restore_optimizers() -> None:
    import torch

    while _torch_optimizers:
        name, torch_cls = _torch_optimizers.popitem()
        setattr(torch.optim, name, torch_cls)


def _wrap_init(env: Mapping[str, str]) -> str:
    """``init_process_group`` as the script calls it, with the backend aiakrun chose
    (``AIAK_BACKEND``) when the call names none, and the timeout of the backend's variable
    (``GLOO_TIMEOUT_SECONDS``, ``AIAK_NCCL_TIMEOUT_SECONDS``) when it passes none. Every
    spelling of torch's signature (positional, keywords, defaults) goes through
    :func:`inspect.Signature.bind`, so what reaches torch is the call torch would get."""
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from aiak.comm.env import init_timeout

    backend = env.get("AIAK_BACKEND", "").strip() or None
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"AIAK_BACKEND must be gloo or nccl, got {backend!r}")
    init_timeout(backend, env)  # a malformed timeout variable fails here, at start-up
    if "init" in _saved:
        return ""
    orig = dist.init_process_group
    signature = inspect.signature(orig)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a call torch refuses: torch's own error
            return orig(*args, **kwargs)
        given = bound.arguments
        if given.get("backend") is None and backend is not None:
            given["backend"] = backend
        if given.get("timeout") is None:
            timeout = init_timeout(given.get("backend"), env)
            if timeout is not None:
                given["timeout"] = timeout
        _restart_store(given)
        return orig(*bound.args, **bound.kwargs)

    init_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    init_process_group.__doc__ = orig.__doc__
    _saved["init"] = orig
    dist.init_process_group = c10d.init_process_group = init_process_group
    said = []
    if backend is not None:
        said.append(f"defaults to {backend}")
    timeout = init_timeout(backend, env)
    if timeout is not None:
        said.append(f"times out after {timeout.total_seconds():g} s")
    return f"launch: init_process_group() {' and '.join(said)}" if said else ""


def _restart_store(given: dict[str, Any]) -> None:
    """After a restart by torch's elastic agent, a store of this attempt's own.

    The agent's store outlives its workers, and torch's ``env://`` gives every attempt the same
    keys: the restarted ranks read the dead attempt's gloo addresses from it and fail
    ("connectFullMesh failed ... Connection refused"; plain torchrun does the same). A prefix
    per attempt keeps each attempt's keys apart, as ``init_process_group(store=...)`` allows."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return
    if given.get("store") is not None or given.get("init_method") not in (None, "env://"):
        return
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.constants import default_pg_timeout

    timeout = given.get("timeout") or default_pg_timeout
    client = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
    )
    given.pop("init_method", None)
    given["store"] = PrefixStore(f"aiak/attempt_{attempt}/", client)
    if given.get("rank", -1) == -1:
        given["rank"] = int(os.environ["RANK"])
    if given.get("world_size", -1) == -1:
        given["world_size"] = int(os.environ["WORLD_SIZE"])


def _record_errors(env: Mapping[str, str]) -> None:
    """Under torch's elastic launcher (aiakrun, torchrun), an uncaught exception also goes to
    the worker's error file, as torch's ``@record`` writes it: the launcher's failure table then
    shows the root cause's traceback for an unchanged script."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path or "excepthook" in _saved:
        return
    previous = sys.excepthook
    _saved["excepthook"] = previous

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        import json
        import time
        import traceback

        if not os.path.exists(path):  # a script's own @record wrote it first
            text = "".join(traceback.format_exception(kind, value, tb))
            data = {
                "message": {
                    "message": f"{kind.__name__}: {value}",
                    "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
                }
            }
            try:
                with open(path, "w") as f:
                    json.dump(data, f)
            except OSError:
                pass  # the traceback still goes to stderr below
        previous(kind, value, tb)

    sys.excepthook = excepthook


class AfterTorch:
    """One-shot finder: lets the real finders load ``torch``, then calls ``then()`` (aiak's
    activation; aiak-advise's probe)."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        _remove_finder(self.then)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            run(module)
            then()

        spec.loader.exec_module = exec_module  # this spec's loader only
        return spec


def _remove_finder(then: Callable[[], None] | None = None) -> None:
    """Take out the finders that would call ``then`` (default: aiak's activation)."""
    then = activate if then is None else then
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (isinstance(f, AfterTorch) and f.then is then)
    ]


def boot() -> None:
    """Activate now if torch is loaded, else when it is; nothing without ``AIAK_AUTO=1``."""
    if not enabled():
        return
    if not _started_by_activated:
        _started_by_activated.append(_descendant())
    if "torch" in sys.modules:
        activate()
    elif not any(isinstance(f, AfterTorch) and f.then is activate for f in sys.meta_path):
        sys.meta_path.insert(0, AfterTorch(activate))
