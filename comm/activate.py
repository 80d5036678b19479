"""Activation from the environment, and registration on DDP.

:func:`build` turns the parsed variables (:class:`~aiak.comm.env.EnvConfig`) into a hook tree;
:func:`register` sets a tree up on a DDP model; :func:`ddp` builds the model with the
environment's bucket size and registers the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._base import CommHook, check_coalesce
from .allreduce import allreduce
from .cast import fp16_compress
from .dgc import _dgc_states, dgc
from .downsample import downsample
from .env import EnvConfig, parse_env
from .hierarchical import hierarchical
from .multi_stream import multi_stream
from .nan_check import nan_check
from .perf_check import watch
from .powersgd import powersgd

__all__ = ["build", "ddp", "from_env", "register"]


def build(cfg: EnvConfig) -> CommHook | None:
    """The hook these settings ask for; ``None`` when they ask for DDP's own allreduce."""
    hook = _dgc(cfg) if cfg.dgc is not None else _reduction(cfg)
    extras = cfg.streams > 1 or cfg.nancheck or cfg.log_steps or cfg.coalesce > 1
    if hook is None:
        if not extras:
            return None
        hook = allreduce()
    if cfg.nancheck:
        hook = nan_check(hook)
    hook.state.log_every = cfg.log_steps
    hook.state.coalesce = cfg.coalesce
    return hook


def _dgc(cfg: EnvConfig) -> CommHook:
    # parse_env refused every other compression beside DGC
    kw = dict(cfg.dgc or ())
    if "clip_grad_func_params" in kw:
        kw["clip_grad_func_params"] = dict(kw["clip_grad_func_params"])
    hook = dgc(**kw)
    hook.state.awaits_optimizer = True  # its momentum is the SGD's (link_dgc_optimizer)
    return hook


def _reduction(cfg: EnvConfig) -> CommHook | None:
    """The allreduce tree (two levels, fp16, PowerSGD, downsampling); ``None``: plain."""
    fp16_everywhere = cfg.fp16 or cfg.dtype == 0
    fp16_inter = cfg.dtype == 2
    two_level = cfg.hierarchical or cfg.mode == 1 or (cfg.mode is None and fp16_inter)
    if cfg.powersgd:
        slow: CommHook = powersgd(rank=cfg.rank, start_iter=cfg.start_iter)
    elif fp16_inter or (fp16_everywhere and not two_level):
        slow = fp16_compress(scale=cfg.scale)
    else:
        slow = allreduce()
    if cfg.streams > 1:
        slow = multi_stream(slow, cfg.streams)
    plain = not (two_level or fp16_everywhere or fp16_inter or cfg.powersgd or cfg.downsample > 1)
    if plain and cfg.streams == 1:
        return None
    hook = hierarchical(outer=slow) if two_level else slow
    if two_level and fp16_everywhere:  # the whole two-level exchange in fp16
        hook = fp16_compress(hook, scale=cfg.scale)
    if cfg.downsample > 1:
        hook = downsample(hook, cfg.downsample, cfg.momentum)
    return hook


def from_env(environ: Mapping[str, str] | None = None) -> CommHook | None:
    """The hook the environment asks for, or ``None`` for DDP's built-in allreduce."""
    return build(parse_env(environ))


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
    hook = build(cfg) if hook is None else hook
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


# DDP's bucket size (MiB) for DGC when PERSEUS_ALLREDUCE_FUSION is auto. DGC's cost per bucket
# is host time (its hook's Python and ~40 launches: 3-5 ms a bucket on a lent H100 host, spent
# inside a host-bound backward) plus one collective; its bytes are ~1% of the gradients.
# Fewer buckets cost less but hide less of the exchange behind the backward, which a slow link
# needs. ResNet-50 b32, 2 nodes x 2 H100 over sockets, DGC 0.001 against the flat allreduce of
# the same run: DDP's default 5 buckets 0.99-1.08x (22.5x at 1 Gbit/s), 50 MiB (2 buckets)
# 1.51x and 1.63x in two runs (30.1x, 32.8x at 1 Gbit/s), 128 MiB (1 bucket) 1.25-1.61x but
# 15.8x at 1 Gbit/s.
DGC_BUCKET_MB = 50.0


def bucket_cap_mb(environ: Mapping[str, str] | None = None) -> float | None:
    """DDP's ``bucket_cap_mb`` from ``PERSEUS_ALLREDUCE_FUSION``; when that is auto (unset),
    :data:`DGC_BUCKET_MB` with ``AIAK_DGC=1``, else ``None`` (DDP's default)."""
    cfg = parse_env(environ)
    if cfg.fusion_mb is None and cfg.dgc is not None:
        return DGC_BUCKET_MB
    return cfg.fusion_mb


def ddp(
    module: torch.nn.Module,
    hook: CommHook | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` with the env's bucket size and hook (or
    ``hook``); with DGC in the hook and no ``PERSEUS_ALLREDUCE_FUSION``, buckets of
    ``DGC_BUCKET_MB`` (DGC pays per bucket, not per byte)."""
    cap = bucket_cap_mb(environ)
    if cap is None and hook is not None and _dgc_states(hook.state):
        cap = DGC_BUCKET_MB
    if cap is not None:
        kwargs.setdefault("bucket_cap_mb", cap)
    model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    register(model, hook, environ=environ)
    return model
