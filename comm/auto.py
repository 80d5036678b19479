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
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _dgc_auto
from .activate import bucket_cap_mb, build, register
from .env import DGC_VARIABLES, OVERLAP_VARIABLE, EnvConfig, parse_env
from .lifecycle import shutdown
from .overlap import overlap_step

__all__ = ["activate", "active", "check", "deactivate", "notices", "optimizer_builders"]

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
    OVERLAP_VARIABLE,
    *DGC_VARIABLES,
)

_saved: dict[str, Any] = {}  # "init" -> DDP.__init__ as found; empty when not active
_logged: set[str] = set()


def _asked(env: Mapping[str, str]) -> list[str]:
    cfg = parse_env(env)
    asks = build(cfg) is not None or cfg.perf_steps > 0 or cfg.fusion_mb is not None
    asks = asks or cfg.overlap
    if not asks:
        return []
    return [f"{k}={env[k]}" for k in VARIABLES if k in env]


def optimizer_builders(
    environ: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, Any, tuple[type, ...]]]:
    """``torch.optim`` name -> (the variable, builder from torch's optimizer, its classes):
    with ``AIAK_DGC=1``, ``torch.optim.SGD`` is built as ``DGCSGD`` (the launcher's start-up
    hook does the swap)."""
    if parse_env(os.environ if environ is None else environ).dgc is None:
        return {}
    return {"SGD": ("AIAK_DGC", _dgc_auto.build_sgd, (_dgc_auto.DGCSGD,))}


def notices(environ: Mapping[str, str], nodes: int | None) -> list[str]:
    """Settings that change nothing, or not yet, for an unchanged script: said once at start-up
    (by aiakrun, else by rank 0's activation). ``nodes``: the job's node count, if known."""
    cfg = parse_env(environ)
    out = []
    if cfg.accumulate > 1:
        out.append(
            f"PERSEUS_ACCUMULATE_N_STEPS={cfg.accumulate} (--accumulate-n-steps) applies to "
            "scripts that use aiak.comm.accumulate; an unchanged script steps and "
            "communicates every backward"
        )
    if cfg.powersgd:
        out.append(
            f"PowerSGD compresses from step {cfg.start_iter} (AIAK_START_COMPRESS_ITER, "
            "--start-compress-iter); the steps before send dense gradients"
        )
    if cfg.hierarchical and nodes == 1:
        out.append(
            "AIAK_HIERARCHICAL_ALLREDUCE=1 (--hierarchical-allreduce) on one node is a flat "
            "allreduce: two levels need two nodes"
        )
    return out


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
    if _rank0() and not env.get("AIAK_BACKEND"):  # aiakrun (which sets it) said them already
        nodes = env.get("GROUP_WORLD_SIZE", "")
        for line in notices(env, int(nodes) if nodes.isdigit() else None):
            logger.warning("%s", line)
    if not names:
        return []
    if parse_env(env).dgc is not None:
        if (env.get("AIAK_FUSED_OPTIMIZER") or "0").strip() == "1":
            _unwrap_destroy()
            raise ValueError(
                "AIAK_DGC=1 contradicts AIAK_FUSED_OPTIMIZER=1: DGC steps its own SGD (DGCSGD)"
            )
        _dgc_auto.activate()
    if parse_env(env).overlap:
        _track_optimizers()
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    orig = ddp_cls.__init__
    _saved["init"] = vars(ddp_cls).get("__init__")

    @functools.wraps(orig)
    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        cfg = parse_env(env)
        # bucket_cap_mb is DDP's 7th parameter; an explicit one must agree (register checks).
        cap = bucket_cap_mb(env)
        if cap is not None and "bucket_cap_mb" not in kwargs and len(args) < 6:
            kwargs["bucket_cap_mb"] = cap
        orig(self, module, *args, **kwargs)
        if cfg.overlap:  # overlap_step registers the hook, at the first forward
            hook = build(cfg)
            _overlap_at_first_forward(self, hook, cfg)
            self._aiak_hook = hook
            _dgc_auto.on_ddp(self, hook)  # a DGC hook is linked to its DGCSGD either way
        else:
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
            extra += ", the optimizer stepping bucket by bucket" if cfg.overlap else ""
            logger.info(
                "comm: DDP registered %s%s (%d B of gradients per step, %g MiB buckets)",
                what,
                extra,
                grads,
                self.bucket_bytes_cap / 2**20,
            )

    ddp_cls.__init__ = __init__
    return ["comm: DDP models use the hook from " + " ".join(names)]


# Optimizers built while the overlap is on (weak), newest last: the overlap takes the newest
# one that holds exactly a DDP model's trainable parameters.
_optimizers: list[weakref.ref] = []


def _track_optimizers() -> None:
    """Remember every optimizer built (``torch.optim.Optimizer.__init__``, which every torch
    and aiak optimizer runs): the script never hands its optimizer to aiak."""
    orig = torch.optim.Optimizer.__init__
    _saved["optimizer_init"] = orig

    @functools.wraps(orig)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        _optimizers.append(weakref.ref(self))

    torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]


class _OwnStep:
    """The optimizer as the overlap's stepper sees it: its class's ``step`` (the parameters'
    update), while the script's ``optimizer.step()`` is a no-op (the step ran in backward)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        object.__setattr__(self, "_optimizer", optimizer)

    def step(self, closure: Any = None) -> Any:
        return type(self._optimizer).step(self._optimizer, closure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._optimizer, name, value)


def _stepped_in_backward(optimizer: torch.optim.Optimizer) -> None:
    def step(closure: Any = None) -> None:
        if closure is not None:
            raise ValueError(
                f"{OVERLAP_VARIABLE}=1: optimizer.step(closure) cannot run, the overlap steps "
                "the parameters during backward"
            )
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check

    optimizer.step = step  # type: ignore[method-assign]


def _overlap_at_first_forward(
    model: torch.nn.parallel.DistributedDataParallel, hook: Any, cfg: EnvConfig
) -> None:
    """At the model's first forward (its optimizer exists by then in a training script),
    :func:`aiak.comm.overlap_step` with the newest optimizer over the model's parameters."""
    handle: list[Any] = []

    def pre_forward(module: torch.nn.Module, inputs: Any) -> None:
        handle.pop().remove()
        mine = {id(p) for p in model.module.parameters() if p.requires_grad}
        found = None
        for ref in reversed(_optimizers):
            opt = ref()
            if opt is not None and {id(p) for g in opt.param_groups for p in g["params"]} == mine:
                found = opt
                break
        if found is None:
            raise ValueError(
                f"{OVERLAP_VARIABLE}=1 (aiakrun --overlap-backward-and-step): at the DDP "
                "model's first forward, no optimizer holds exactly its trainable parameters; "
                "build the optimizer over ddp.parameters() before the first forward"
            )
        func, params = cfg.clip if cfg.clip is not None else (None, ())
        stepper = overlap_step(model, found, func, dict(params), hook=hook)
        stepper.optimizer = _OwnStep(found)  # type: ignore[assignment]
        _stepped_in_backward(found)
        if "overlap" not in _logged and _rank0():
            _logged.add("overlap")
            logger.info(
                "comm: %s steps during backward, bucket by bucket%s; the script's "
                "optimizer.step() does nothing",
                type(found).__name__,
                f" (clipping: {func} {dict(params)})" if func else "",
            )

    handle.append(model.register_forward_pre_hook(pre_forward))


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
    if "optimizer_init" in _saved:
        torch.optim.Optimizer.__init__ = _saved.pop("optimizer_init")  # type: ignore[method-assign]
    _optimizers.clear()
    _logged.clear()


def active() -> bool:
    return bool(_saved)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` (naming the variable) for a malformed or contradictory variable."""
    parse_env(os.environ if environ is None else environ)
