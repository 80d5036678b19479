"""aiak.comm's part of activation without code change (``aiakrun``, ``AIAK_AUTO=1``).

:func:`activate` reads comm's variables (:func:`aiak.comm.parse_env`: a bad value is a
``ValueError`` at start-up) and, only when they ask for something, wraps
``DistributedDataParallel.__init__`` so that every DDP model built afterwards gets the env's
bucket size and registers the env's hook (:func:`aiak.comm.register`), slow-rank detection
included. Always (hook or not) it makes ``torch.distributed.destroy_process_group()`` of the
whole world go through :func:`aiak.comm.shutdown` (no barrier): an unchanged script that
destroys the group while its DDP model is alive otherwise leaves the model (and any aiak hook
state) holding the group into the interpreter's teardown, where gloo threads running Python
abort the process. That is torch's own teardown, no aiak hook needed: examples/ddp_plain.py on
2 gloo ranks aborts at exit in about 1 run of 20 without the wrap (1 of 30 under torchrun, 2 of
30 under aiakrun) and in 0 of 120 with it. :func:`deactivate` restores both.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _dgc_auto
from .activate import build, register
from .env import DGC_VARIABLES, parse_env
from .lifecycle import shutdown

__all__ = ["activate", "active", "check", "deactivate"]

logger = logging.getLogger("aiak.comm")

# The variables comm reads (parse_env), named in the activation's log line.
VARIABLES = (
    "AIAK_HIERARCHICAL_ALLREDUCE",
    "AIAK_FP16_COMPRESSION",
    "AIAK_POWERSGD_COMPRESSION",
    "AIAK_MATRIX_APPROXIMATION_RANK",
    "AIAK_START_COMPRESS_ITER",
    "AIAK_COMM_LOG_STEPS",
    "AIAK_COALESCE_BUCKETS",
    "AIAK_PERF_CHECK_MARGIN",
    "PERSEUS_ALLREDUCE_DTYPE",
    "PERSEUS_ALLREDUCE_MODE",
    "PERSEUS_ALLREDUCE_NANCHECK",
    "PERSEUS_ALLREDUCE_GRADIENT_SCALE",
    "PERSEUS_ALLREDUCE_STREAMS",
    "PERSEUS_ALLREDUCE_FUSION",
    "PERSEUS_ACCUMULATE_N_STEPS",
    "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
    "PERSEUS_GRADIENT_MOMENTUM",
    "PERSEUS_PERF_CHECK_N_STEPS",
    *DGC_VARIABLES,
)

_saved: dict[str, Any] = {}  # "init" -> DDP.__init__ as found; empty when not active
_logged: set[str] = set()


def _asked(env: Mapping[str, str]) -> list[str]:
    cfg = parse_env(env)
    asks = build(cfg) is not None or cfg.perf_steps > 0 or cfg.fusion_mb is not None
    if not asks:
        return []
    return [f"{k}={env[k]}" for k in VARIABLES if k in env]


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def activate(environ: Mapping[str, str] | None = None) -> list[str]:
    """Route the world's ``destroy_process_group`` through ``shutdown`` and, when comm's
    variables ask for a hook, patch DDP; returns what was switched on (or [])."""
    env = dict(os.environ if environ is None else environ)
    names = _asked(env)
    if _saved:
        return []
    _wrap_destroy()
    if not names:
        return []
    if parse_env(env).dgc is not None:
        if (env.get("AIAK_FUSED_OPTIMIZER") or "0").strip() == "1":
            _unwrap_destroy()
            raise ValueError(
                "AIAK_DGC=1 contradicts AIAK_FUSED_OPTIMIZER=1: DGC steps its own SGD (DGCSGD)"
            )
        _dgc_auto.activate()
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    orig = ddp_cls.__init__
    _saved["init"] = vars(ddp_cls).get("__init__")

    @functools.wraps(orig)
    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        cfg = parse_env(env)
        # bucket_cap_mb is DDP's 7th parameter; an explicit one must agree (register checks).
        if cfg.fusion_mb is not None and "bucket_cap_mb" not in kwargs and len(args) < 6:
            kwargs["bucket_cap_mb"] = cfg.fusion_mb
        orig(self, module, *args, **kwargs)
        hook = register(self, environ=env)
        self._aiak_hook, self._aiak_auto = hook, True  # a later register() call sees them
        _dgc_auto.on_ddp(self, hook)
        if "ddp" not in _logged and _rank0():
            _logged.add("ddp")
            grads = sum(
                p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
            )
            what = getattr(hook, "__name__", "torch's allreduce")
            extra = ", slow-rank check" if cfg.perf_steps else ""
            logger.info(
                "comm: DDP registered %s%s (%d B of gradients per step)", what, extra, grads
            )

    ddp_cls.__init__ = __init__
    return ["comm: DDP models use the hook from " + " ".join(names)]


def _wrap_destroy() -> None:
    orig_destroy = dist.destroy_process_group
    _saved["destroy"] = orig_destroy

    @functools.wraps(orig_destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            shutdown(barrier=False)  # releases DDP models and hook states, then destroys
        else:
            orig_destroy(group)

    dist.destroy_process_group = destroy_process_group


def _unwrap_destroy() -> None:
    dist.destroy_process_group = _saved.pop("destroy")


def deactivate() -> None:
    """Restore ``DistributedDataParallel.__init__`` and ``destroy_process_group``. Idempotent."""
    if not _saved:
        return
    if "init" in _saved:
        ddp_cls = torch.nn.parallel.DistributedDataParallel
        before = _saved.pop("init")
        if before is None:
            del ddp_cls.__init__
        else:
            ddp_cls.__init__ = before
    _unwrap_destroy()
    _dgc_auto.deactivate()
    _logged.clear()


def active() -> bool:
    return bool(_saved)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` (naming the variable) for a malformed or contradictory variable."""
    parse_env(os.environ if environ is None else environ)
