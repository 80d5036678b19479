"""The one reader of aiak.comm's environment variables.

AIAK_* / PERSEUS_* select and tune the hooks (:func:`parse_env`); ``GLOO_TIMEOUT_SECONDS``
bounds every gloo collective (:func:`gloo_timeout`), ``AIAK_NCCL_TIMEOUT_SECONDS`` every NCCL
one (both applied to unchanged scripts: :func:`init_timeout`); torchrun's ``GROUP_RANK`` /
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


def _in_downsample_range(v: int) -> bool:
    return 1 <= v <= 1024


__all__ = [
    "EnvConfig",
    "gloo_timeout",
    "init_timeout",
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
    # AIAK_DGC=1: aiak.comm.dgc's keyword arguments from AIAK_DGC_* / AIAK_CLIP_GRAD_FUNC*
    dgc: tuple[tuple[str, Any], ...] | None = None
    overlap: bool = False  # AIAK_OVERLAP_BACKWARD_AND_STEP: aiak.comm.overlap_step by activation
    # with the overlap: ("norm" | "value", ((keyword, bound),)) from AIAK_CLIP_GRAD_FUNC*
    clip: tuple[str, tuple[tuple[str, float], ...]] | None = None


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
        downsample=n(  # the bound is aiak.comm.downsample's MAX_N
            env, "PERSEUS_DOWNSAMPLE_N_ELEMENTS", int, 1, _in_downsample_range, "an int in 1..1024"
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
    _seconds(env, "GLOO_TIMEOUT_SECONDS")
    _seconds(env, NCCL_TIMEOUT_VARIABLE)
    overlap = _flag(env, OVERLAP_VARIABLE)
    dgc = _dgc_settings(env, overlap)
    if overlap:  # with DGC the clipping runs inside DGC's hook, not a second time
        cfg = dataclasses.replace(cfg, overlap=True, clip=None if dgc is not None else _clip(env))
    if dgc is not None:
        cfg = dataclasses.replace(cfg, dgc=dgc)
        others = [
            name
            for name, on in (
                ("AIAK_FP16_COMPRESSION", cfg.fp16),
                ("AIAK_POWERSGD_COMPRESSION", cfg.powersgd),
                ("AIAK_HIERARCHICAL_ALLREDUCE", cfg.hierarchical),
                ("PERSEUS_ALLREDUCE_DTYPE", cfg.dtype in (0, 2)),
                ("PERSEUS_ALLREDUCE_MODE", cfg.mode == 1),
                ("PERSEUS_DOWNSAMPLE_N_ELEMENTS", cfg.downsample > 1),
                ("PERSEUS_ALLREDUCE_STREAMS", cfg.streams > 1),
            )
            if on
        ]
        if others:
            raise ValueError(
                f"AIAK_DGC=1 contradicts {', '.join(others)}: DGC is the whole exchange "
                "(one allgather of the selected gradients over all ranks); choose one"
            )
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


_UNIT = (lambda v: 0 < v <= 1, "a number in (0, 1]")
_BOOL = (lambda v: v in (0, 1), "0 or 1")
# variable -> (dgc() keyword, type, check, what the check expects); dgc()'s own ranges
_DGC_VARS: dict[str, tuple[str, Callable[[str], Any], Callable[[Any], bool], str]] = {
    "AIAK_DGC_COMPRESS_RATIO": ("compress_ratio", float, *_UNIT),
    "AIAK_DGC_SAMPLE_RATIO": ("sample_ratio", float, *_UNIT),
    "AIAK_DGC_STRIDED_SAMPLE": ("strided_sample", int, *_BOOL),
    "AIAK_DGC_COMPRESS_UPPER_BOUND": (
        "compress_upper_bound",
        float,
        lambda v: 1 < v < float("inf"),
        "a finite number > 1",
    ),
    "AIAK_DGC_COMPRESS_LOWER_BOUND": (
        "compress_lower_bound",
        float,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
    ),
    "AIAK_DGC_MAX_ADAPTATION_ITERS": (
        "max_adaptation_iters",
        int,
        lambda v: 0 <= v <= 20,
        "an integer in 0..20",
    ),
    "AIAK_DGC_RESAMPLE": ("resample", int, *_BOOL),
    "AIAK_DGC_FP16_VALUES": ("fp16_values", int, *_BOOL),
    "AIAK_DGC_INT32_INDICES": ("int32_indices", int, *_BOOL),
    "AIAK_DGC_WARMUP_EPOCHS": (
        "warmup_epochs",
        int,
        lambda v: v >= -1,
        "an integer >= -1 (-1: no warm-up)",
    ),
    "AIAK_DGC_MOMENTUM_MASKING": ("momentum_masking", int, *_BOOL),
}
_CLIP_VARS = ("AIAK_CLIP_GRAD_FUNC", "AIAK_CLIP_GRAD_FUNC_PARAMS")
_DGC_EXTRA = ("AIAK_DGC_WARMUP_COEFF", *_CLIP_VARS)
OVERLAP_VARIABLE = "AIAK_OVERLAP_BACKWARD_AND_STEP"
DGC_VARIABLES = ("AIAK_DGC", *_DGC_VARS, *_DGC_EXTRA)


def _dgc_settings(
    env: Mapping[str, str], overlap: bool = False
) -> tuple[tuple[str, Any], ...] | None:
    """``AIAK_DGC=1``'s settings as ``dgc()`` keywords; its variables without it are errors
    (the clipping's two also belong to the overlap, ``overlap``)."""
    on = _flag(env, "AIAK_DGC")
    shared = _CLIP_VARS if overlap else ()
    given = [k for k in (*_DGC_VARS, *_DGC_EXTRA) if _get(env, k) is not None and k not in shared]
    if not on:
        if given:
            raise ValueError(f"{given[0]} is a DGC setting: it needs AIAK_DGC=1")
        return None
    kw: dict[str, Any] = {}
    for name, (key, kind, ok, expect) in _DGC_VARS.items():
        value = _number(env, name, kind, None, ok, expect)
        if value is not None:
            kw[key] = bool(value) if expect == _BOOL[1] else value
    raw = _get(env, "AIAK_DGC_WARMUP_COEFF")
    if raw is not None:  # one ratio, or one per warm-up epoch separated by spaces
        try:
            coeff = [float(c) for c in raw.split()]
        except ValueError:
            coeff = []
        warm = kw.get("warmup_epochs", -1)
        if not coeff or not all(0 < c <= 1 for c in coeff) or 1 < len(coeff) < warm:
            raise ValueError(
                "AIAK_DGC_WARMUP_COEFF must be one ratio in (0, 1] or one per warm-up epoch "
                f"(AIAK_DGC_WARMUP_EPOCHS={warm}), separated by spaces, got {raw!r}"
            )
        kw["warmup_coeff"] = coeff[0] if len(coeff) == 1 else tuple(coeff)
    clip = _clip(env)
    if clip is not None:
        kw["clip_grad_func"], kw["clip_grad_func_params"] = clip
    return tuple(sorted(kw.items()))


def _clip(env: Mapping[str, str]) -> tuple[str, tuple[tuple[str, float], ...]] | None:
    """``AIAK_CLIP_GRAD_FUNC`` / ``_PARAMS`` as ``(function, ((keyword, bound),))`` (hashable)."""
    func = _get(env, "AIAK_CLIP_GRAD_FUNC")
    if func is not None and func not in ("norm", "value"):
        raise ValueError(f"AIAK_CLIP_GRAD_FUNC must be norm or value, got {func!r}")
    bound = _number(
        env, "AIAK_CLIP_GRAD_FUNC_PARAMS", float, None, lambda v: 0 < v < float("inf"), "> 0"
    )
    if (func is None) != (bound is None):
        raise ValueError(
            "AIAK_CLIP_GRAD_FUNC and AIAK_CLIP_GRAD_FUNC_PARAMS go together (the clipping and "
            "its max norm / value)"
        )
    if func is None:
        return None
    return func, (({"norm": "max_norm", "value": "clip_value"}[func], bound),)


# The longest timeout accepted: a year. gloo keeps it in milliseconds and timedelta refuses
# values past ~2.7e6 years, so larger numbers (1e20, inf) could only overflow somewhere deeper.
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0
NCCL_TIMEOUT_VARIABLE = "AIAK_NCCL_TIMEOUT_SECONDS"


def _seconds(env: Mapping[str, str], name: str) -> datetime.timedelta | None:
    raw = _get(env, name)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 1e-3 <= seconds <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise ValueError(
            f"{name} must be a number of seconds from 0.001 to "
            f"{MAX_TIMEOUT_SECONDS:.0f} (a year), got {raw!r}"
        )
    return datetime.timedelta(seconds=seconds)


def gloo_timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """The collective timeout from ``GLOO_TIMEOUT_SECONDS`` (default 60 s, as Perseus)."""
    env = os.environ if environ is None else environ
    return _seconds(env, "GLOO_TIMEOUT_SECONDS") or datetime.timedelta(seconds=60)


def init_timeout(
    backend: str | None, environ: Mapping[str, str] | None = None
) -> datetime.timedelta | None:
    """The ``timeout=`` that ``init_process_group(backend)`` gets under activation, from the
    variables that are set: ``GLOO_TIMEOUT_SECONDS`` for gloo, ``AIAK_NCCL_TIMEOUT_SECONDS``
    for NCCL, the shorter of the two for a backend naming both (``None``, torch's default
    ``cpu:gloo,cuda:nccl``). ``None`` when none applies: torch's own default stays."""
    env = os.environ if environ is None else environ
    name = (backend or "gloo,nccl").lower()
    pairs = (("gloo", "GLOO_TIMEOUT_SECONDS"), ("nccl", NCCL_TIMEOUT_VARIABLE))
    found = [t for key, var in pairs if key in name and (t := _seconds(env, var)) is not None]
    return min(found) if found else None


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
