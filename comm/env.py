"""Activation from the AIAK_*/PERSEUS_* environment variables, and registration on DDP.

Every variable is validated, used or not: a malformed value (``AIAK_FP16_COMPRESSION=yes``) or
a contradiction (``AIAK_HIERARCHICAL_ALLREDUCE=1`` with ``PERSEUS_ALLREDUCE_MODE=0``) is a
``ValueError`` naming the variable, at start-up, never a silent default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._wire import gloo_timeout
from .downsample import downsample
from .hierarchical import hierarchical
from .hooks import (
    CommHook,
    allreduce,
    check_coalesce,
    fp16_compress,
    multi_stream,
    nan_check,
)
from .perf_check import watch
from .powersgd import powersgd

__all__ = ["EnvConfig", "bucket_cap_mb", "ddp", "from_env", "parse_env", "register"]


def _get(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise TypeError(f"{name} must be a string (an environment value), got {type(raw).__name__}")
    return raw.strip() or None


def _number(
    env: Mapping[str, str],
    name: str,
    kind: Callable[[str], Any],
    default: Any,
    ok: Callable[[Any], bool],
    expect: str,
) -> Any:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name} must be {expect}, got {raw!r}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    return bool(_number(env, name, int, 0, lambda v: v in (0, 1), "0 or 1"))


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The parsed variables; ``None`` where a variable is unset and its default is 'auto'."""

    hierarchical: bool = False  # AIAK_HIERARCHICAL_ALLREDUCE
    fp16: bool = False  # AIAK_FP16_COMPRESSION
    powersgd: bool = False  # AIAK_POWERSGD_COMPRESSION
    rank: int = 1  # AIAK_MATRIX_APPROXIMATION_RANK
    start_iter: int = 1000  # AIAK_START_COMPRESS_ITER
    dtype: int | None = None  # PERSEUS_ALLREDUCE_DTYPE: 0 fp16, 1 none, 2 fp16 inter-node only
    mode: int | None = None  # PERSEUS_ALLREDUCE_MODE: 0 flat, 1 two-level, None auto
    nancheck: bool = False  # PERSEUS_ALLREDUCE_NANCHECK
    scale: float = 10.0  # PERSEUS_ALLREDUCE_GRADIENT_SCALE
    streams: int = 1  # PERSEUS_ALLREDUCE_STREAMS
    fusion_mb: float | None = None  # PERSEUS_ALLREDUCE_FUSION (DDP bucket size, MiB)
    accumulate: int = 1  # PERSEUS_ACCUMULATE_N_STEPS
    log_steps: int = 0  # AIAK_COMM_LOG_STEPS
    coalesce: int = 1  # AIAK_COALESCE_BUCKETS
    downsample: int = 1  # PERSEUS_DOWNSAMPLE_N_ELEMENTS (1: every element every step)
    momentum: float = 1.0  # PERSEUS_GRADIENT_MOMENTUM (memory of the elements not sent)
    perf_steps: int = 0  # PERSEUS_PERF_CHECK_N_STEPS (0: off)
    perf_margin: float = 0.2  # AIAK_PERF_CHECK_MARGIN: a rank this fraction over the median

    def build(self) -> CommHook | None:
        """The hook these settings ask for; ``None`` when they ask for DDP's own allreduce."""
        fp16_everywhere = self.fp16 or self.dtype == 0
        fp16_inter = self.dtype == 2
        two_level = self.hierarchical or self.mode == 1 or (self.mode is None and fp16_inter)
        if self.powersgd:
            slow: CommHook = powersgd(rank=self.rank, start_iter=self.start_iter)
        elif fp16_inter or (fp16_everywhere and not two_level):
            slow = fp16_compress(scale=self.scale)
        else:
            slow = allreduce()
        if self.streams > 1:
            slow = multi_stream(slow, self.streams)
        hook = hierarchical(outer=slow) if two_level else slow
        if two_level and fp16_everywhere:  # the whole two-level exchange in fp16
            hook = fp16_compress(hook, scale=self.scale)
        if self.downsample > 1:
            hook = downsample(hook, self.downsample, self.momentum)
        if self.nancheck:
            hook = nan_check(hook)
        plain = not (
            two_level or fp16_everywhere or fp16_inter or self.powersgd or self.downsample > 1
        )
        extras = self.streams > 1 or self.nancheck or self.log_steps or self.coalesce > 1
        if plain and not extras:
            return None
        hook.state.log_every = self.log_steps
        hook.state.coalesce = self.coalesce
        return hook


def parse_env(environ: Mapping[str, str] | None = None) -> EnvConfig:
    """Read and check every variable (see the README table); raises ``ValueError``."""
    env = os.environ if environ is None else environ
    n = _number
    cfg = EnvConfig(
        hierarchical=_flag(env, "AIAK_HIERARCHICAL_ALLREDUCE"),
        fp16=_flag(env, "AIAK_FP16_COMPRESSION"),
        powersgd=_flag(env, "AIAK_POWERSGD_COMPRESSION"),
        rank=n(env, "AIAK_MATRIX_APPROXIMATION_RANK", int, 1, lambda v: v >= 1, "an integer >= 1"),
        start_iter=n(
            env,
            "AIAK_START_COMPRESS_ITER",
            int,
            1000,
            lambda v: v > 1,
            "an integer > 1 (PowerSGD's error feedback needs DDP's rebuilt buckets)",
        ),
        dtype=n(env, "PERSEUS_ALLREDUCE_DTYPE", int, None, lambda v: v in (0, 1, 2), "0, 1 or 2"),
        mode=None
        if (_get(env, "PERSEUS_ALLREDUCE_MODE") or "auto").lower() == "auto"
        else n(env, "PERSEUS_ALLREDUCE_MODE", int, None, lambda v: v in (0, 1), "0, 1 or auto"),
        nancheck=_flag(env, "PERSEUS_ALLREDUCE_NANCHECK"),
        scale=n(
            env,
            "PERSEUS_ALLREDUCE_GRADIENT_SCALE",
            float,
            10.0,
            lambda v: 0 < v < float("inf"),
            "a finite number > 0",
        ),
        streams=n(env, "PERSEUS_ALLREDUCE_STREAMS", int, 1, lambda v: 1 <= v <= 12, "in 1..12"),
        fusion_mb=None
        if (_get(env, "PERSEUS_ALLREDUCE_FUSION") or "auto").lower() == "auto"
        else n(
            env,
            "PERSEUS_ALLREDUCE_FUSION",
            float,
            None,
            lambda v: 0 <= v <= 128,
            "a bucket size in MiB in 0..128, or auto",
        ),
        accumulate=n(
            env, "PERSEUS_ACCUMULATE_N_STEPS", int, 1, lambda v: v >= 1, "an integer >= 1"
        ),
        log_steps=n(env, "AIAK_COMM_LOG_STEPS", int, 0, lambda v: v >= 0, "an integer >= 0"),
        coalesce=n(env, "AIAK_COALESCE_BUCKETS", int, 1, lambda v: v >= 1, "an integer >= 1"),
        downsample=n(
            env, "PERSEUS_DOWNSAMPLE_N_ELEMENTS", int, 1, lambda v: v >= 1, "an integer >= 1"
        ),
        momentum=n(
            env, "PERSEUS_GRADIENT_MOMENTUM", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"
        ),
        perf_steps=n(
            env, "PERSEUS_PERF_CHECK_N_STEPS", int, 0, lambda v: v >= 0, "an integer >= 0"
        ),
        perf_margin=n(
            env,
            "AIAK_PERF_CHECK_MARGIN",
            float,
            0.2,
            lambda v: 0 < v < float("inf"),
            "a finite number > 0 (0.2: 20% over the median)",
        ),
    )
    if "GLOO_TIMEOUT_SECONDS" in env:
        _check_timeout(env["GLOO_TIMEOUT_SECONDS"])
    conflicts = [
        (
            cfg.hierarchical and cfg.mode == 0,
            "AIAK_HIERARCHICAL_ALLREDUCE=1 contradicts PERSEUS_ALLREDUCE_MODE=0",
        ),
        (
            cfg.dtype == 2 and cfg.mode == 0,
            "PERSEUS_ALLREDUCE_DTYPE=2 (fp16 between nodes) needs two levels, but "
            "PERSEUS_ALLREDUCE_MODE=0",
        ),
        (
            cfg.fp16 and cfg.dtype in (1, 2),
            f"AIAK_FP16_COMPRESSION=1 contradicts PERSEUS_ALLREDUCE_DTYPE={cfg.dtype}",
        ),
        (
            cfg.momentum != 1.0 and cfg.downsample == 1,
            "PERSEUS_GRADIENT_MOMENTUM applies to the elements downsampling keeps back: it needs "
            "PERSEUS_DOWNSAMPLE_N_ELEMENTS > 1",
        ),
        (
            cfg.powersgd and (cfg.fp16 or cfg.dtype in (0, 2)),
            "AIAK_POWERSGD_COMPRESSION=1 with fp16 compression (AIAK_FP16_COMPRESSION or "
            "PERSEUS_ALLREDUCE_DTYPE): choose one",
        ),
    ]
    for bad, msg in conflicts:
        if bad:
            raise ValueError(msg)
    return cfg


def _check_timeout(raw: str) -> None:
    old = os.environ.get("GLOO_TIMEOUT_SECONDS")
    os.environ["GLOO_TIMEOUT_SECONDS"] = raw
    try:
        gloo_timeout()
    finally:
        if old is None:
            del os.environ["GLOO_TIMEOUT_SECONDS"]
        else:
            os.environ["GLOO_TIMEOUT_SECONDS"] = old


def from_env(environ: Mapping[str, str] | None = None) -> CommHook | None:
    """The hook the environment asks for, or ``None`` for DDP's built-in allreduce."""
    return parse_env(environ).build()


def bucket_cap_mb(environ: Mapping[str, str] | None = None) -> float | None:
    """DDP's ``bucket_cap_mb`` from ``PERSEUS_ALLREDUCE_FUSION`` (``None``: DDP's default)."""
    return parse_env(environ).fusion_mb


def register(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    hook: CommHook | None = None,
    state: Any = None,
    environ: Mapping[str, str] | None = None,
    offload: bool | None = None,
    coalesce: int | None = None,
) -> CommHook | None:
    """Register ``hook`` (default: :func:`from_env`) on ``ddp_model``; returns it.

    Sets up groups before training (a collective: call it on every rank) and gives the hook
    the parameter names for its error messages. ``state`` restores a checkpointed state.
    ``offload``: run the hook's Python on aiak's worker thread instead of DDP's autograd
    thread. ``None`` (default): for CUDA gradients when the tree waits for the GPU on the host
    (``nan_check``), whose wait would otherwise stall the backward's launches; other trees are
    cheaper inline. Errors then reach DDP's ``backward()`` through the future.
    ``coalesce``: issue the allreduces of this many consecutive buckets as one collective call
    (``state.coalesce``; default 1). It saves host time per call on host-bound steps with fast
    links; it delays each held bucket's transfer by a bucket, so leave it at 1 on slow links.
    DDP fixes its bucket size at construction, so with ``PERSEUS_ALLREDUCE_FUSION`` set the
    model must have been built with it (see :func:`ddp`); otherwise this raises.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register: ddp_model must be DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    if getattr(ddp_model, "_aiak_auto", False):  # comm.auto registered the env's hook already
        if hook is None:
            return ddp_model._aiak_hook
        raise ValueError(
            "register: aiak's start-up activation (aiakrun / AIAK_AUTO=1) already registered the "
            "environment's hook on this DDP model; DDP takes one hook: unset the AIAK_/PERSEUS_ "
            "comm variables to register your own"
        )
    cfg = parse_env(environ)
    if cfg.fusion_mb is not None and ddp_model.bucket_bytes_cap != int(cfg.fusion_mb * 2**20):
        raise ValueError(
            f"PERSEUS_ALLREDUCE_FUSION={cfg.fusion_mb} MiB but the DDP model was built with "
            f"{ddp_model.bucket_bytes_cap / 2**20:g} MiB buckets; build it with "
            "aiak.comm.ddp(module) or bucket_cap_mb=aiak.comm.bucket_cap_mb()"
        )
    hook = cfg.build() if hook is None else hook
    if hook is None:
        if cfg.perf_steps:
            watch(ddp_model, cfg.perf_steps, margin=cfg.perf_margin)
        return None
    if not isinstance(hook, CommHook):
        raise TypeError(f"register: hook must be an aiak.comm hook, got {type(hook).__name__}")
    state = hook.state if state is None else state
    if offload is not None:
        if not isinstance(offload, bool):
            raise TypeError(f"register: offload must be a bool or None, got {offload!r}")
        state.offload = offload
    if coalesce is not None:
        state.coalesce = check_coalesce("register", coalesce)
    names = {p: name for name, p in ddp_model.module.named_parameters()}
    hook.setup(state, ddp_model.process_group, names)
    if cfg.perf_steps:  # slow-rank detection wraps the hook (comm/perf_check.py)
        watch(ddp_model, cfg.perf_steps, hook, state, margin=cfg.perf_margin)
    else:
        ddp_model.register_comm_hook(state, hook)
    return hook


def ddp(
    module: torch.nn.Module,
    hook: CommHook | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` with the env's bucket size and hook."""
    cap = bucket_cap_mb(environ)
    if cap is not None:
        kwargs.setdefault("bucket_cap_mb", cap)
    model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    register(model, hook, environ=environ)
    return model
