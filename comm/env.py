"""The one reader of aiak.comm's environment variables.

AIAK_* / PERSEUS_* select and tune the hooks (:func:`parse_env`); ``GLOO_TIMEOUT_SECONDS``
bounds every collective (:func:`gloo_timeout`); torchrun's ``GROUP_RANK`` /
``LOCAL_WORLD_SIZE`` place ranks on nodes (:func:`node_key`, :func:`local_world_size`);
``RANK`` names the rank in messages written before a process group exists (:func:`rank_label`).

Every variable is validated, used or not: a malformed value (``AIAK_FP16_COMPRESSION=yes``) or
a contradiction (``AIAK_HIERARCHICAL_ALLREDUCE=1`` with ``PERSEUS_ALLREDUCE_MODE=0``) is a
``ValueError`` naming the variable, at start-up, never a silent default. This module imports
nothing else of aiak.comm, so every other module may import it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "EnvConfig",
    "bucket_cap_mb",
    "gloo_timeout",
    "local_world_size",
    "node_key",
    "parse_env",
    "rank_label",
]


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
        gloo_timeout(env)
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


def bucket_cap_mb(environ: Mapping[str, str] | None = None) -> float | None:
    """DDP's ``bucket_cap_mb`` from ``PERSEUS_ALLREDUCE_FUSION`` (``None``: DDP's default)."""
    return parse_env(environ).fusion_mb


# The longest timeout accepted: a year. gloo keeps it in milliseconds and timedelta refuses
# values past ~2.7e6 years, so larger numbers (1e20, inf) could only overflow somewhere deeper.
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0


def gloo_timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """The collective timeout from ``GLOO_TIMEOUT_SECONDS`` (default 60 s, as Perseus)."""
    env = os.environ if environ is None else environ
    raw = _get(env, "GLOO_TIMEOUT_SECONDS")
    if raw is None:
        return datetime.timedelta(seconds=60)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 1e-3 <= seconds <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise ValueError(
            "GLOO_TIMEOUT_SECONDS must be a number of seconds from 0.001 to "
            f"{MAX_TIMEOUT_SECONDS:.0f} (a year), got {raw!r}"
        )
    return datetime.timedelta(seconds=seconds)


def _env_int(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = _get(environ, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def node_key(environ: Mapping[str, str] | None = None) -> str:
    """This rank's node identity: ``GROUP_RANK`` when torchrun set it, else the hostname."""
    environ = os.environ if environ is None else environ
    _env_int(environ, "LOCAL_WORLD_SIZE", 1)  # validated here so a bad value fails early
    group_rank = _env_int(environ, "GROUP_RANK", 0)
    return f"group:{group_rank}" if group_rank is not None else f"host:{socket.gethostname()}"


def local_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """``LOCAL_WORLD_SIZE`` when torchrun placed the ranks (``GROUP_RANK`` set), else None."""
    environ = os.environ if environ is None else environ
    if "GROUP_RANK" not in environ:
        return None
    return _env_int(environ, "LOCAL_WORLD_SIZE", 1)


def rank_label(environ: Mapping[str, str] | None = None) -> str:
    """``RANK`` as the launcher set it, or ``"?"``: for messages when no group can say."""
    environ = os.environ if environ is None else environ
    raw = environ.get("RANK")
    return raw.strip() if isinstance(raw, str) and raw.strip() else "?"
