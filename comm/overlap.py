"""Overlapping the optimizer step with the backward pass: each bucket's parameters are updated
as soon as that bucket's reduction completes.

``overlap_step`` registers ``hook`` (any aiak hook; default from the environment, else
allreduce) wrapped so that its future runs, in a ``then`` callback, the optimizer on the
bucket's parameters only: the averaged gradient is written into their ``.grad`` (DDP writes
the same values there again when the backward ends) and ``optimizer.step()`` runs with its
``param_groups`` narrowed to those parameters (same hyper-parameters, same per-parameter
state). That works for any optimizer whose ``step`` walks ``param_groups`` when called: torch's
(for-loop, foreach, fused) and aiak.optim's fused ones (which rebuild their launch plan for
each bucket's subset: host time per bucket). Steps of different buckets never run at once (a
lock), and the last one is done when ``backward()`` returns.

Global-norm clipping (``clip_grad_func``, e.g. ``torch.nn.utils.clip_grad_norm_`` with
``clip_grad_func_params={"max_norm": 1.0}``) needs every bucket's gradient: then each bucket's
averaged gradient is only stored when it arrives, and when the last one arrives the function
runs over all parameters and the optimizer steps once over all of them (the communication still
overlaps the backward; the optimizer does not). DGC clips locally inside its hook instead
(per tensor, before compression), which keeps the per-bucket overlap.

Where the time goes (benchmarks/bench_dgc_select.py --overlap: one H100, NCCL world 1,
torchvision ResNet-50, torch SGD with momentum, the variants interleaved in one run): with no
other rank to wait for, there is little for the step to overlap with. At batch 128 the step is
GPU-bound and the plain loop already runs the optimizer's host work while the GPU finishes the
backward (the step costs 1.4 ms over backward alone, for an optimizer that takes 5.3 ms by
itself); the overlapped step took 74.8 ms against the plain 73.8 ms. At batch 32
the step is host-bound: the host work only moves, and the host's run-to-run noise (a few ms)
exceeds the differences. Per-bucket steps cost host time of their own (one
``optimizer.step()`` call per bucket); the gradients are handed over in two foreach calls, not
a copy per parameter. The gain is for multi-GPU steps whose last buckets' reductions keep the
GPU waiting. ``offload=True`` runs the hook and its step on aiak's worker thread and a side
stream (``comm/_offload.py``); on the one-GPU step it measured the same as inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _buckets, _futures
from ._base import CommHook, HookState, Wrapper, check_hook
from ._checks import check_clip
from ._collectives import Link
from .dgc import check_dgc_optimizer

__all__ = ["OverlapState", "OverlapStep", "overlap_step"]


class OverlapState(HookState):
    __slots__ = ("_stepper", "inner")

    def __init__(self, inner: HookState) -> None:
        super().__init__()
        self.inner = inner
        self._stepper: OverlapStep | None = None

    def children(self) -> tuple[HookState, ...]:
        return (self.inner,)


class OverlapStep:
    """What :func:`overlap_step` returns: the registered hook and the per-bucket stepper.

    ``steps`` counts optimizer calls made from buckets (for tests and logs).
    """

    __slots__ = ("_lock", "_pending", "_seen", "clip", "clip_params", "hook", "optimizer", "steps")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        hook: CommHook,
        clip: Callable[..., Any] | None,
        clip_params: Mapping[str, Any],
    ) -> None:
        self.optimizer = optimizer
        self.hook = hook
        self.clip = clip
        self.clip_params = dict(clip_params)
        self.steps = 0
        self._lock = threading.Lock()
        self._seen: dict[int, int] = {}  # step -> parameters received (global clipping)
        self._pending: set[int] = set()

    def _total(self) -> int:
        return sum(len(g["params"]) for g in self.optimizer.param_groups)

    def apply(self, step: int, params: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        with self._lock:
            _set_grads(params, views)
            if self.clip is None:
                self._step_on(params)
                return
            n = self._seen.get(step, 0) + len(params)
            self._seen = {step: n}
            if n >= self._total():
                self.clip(
                    [p for g in self.optimizer.param_groups for p in g["params"]],
                    **self.clip_params,
                )
                self.optimizer.step()
                self.steps += 1

    def _step_on(self, params: list[torch.Tensor]) -> None:
        mine = {id(p) for p in params}
        saved = self.optimizer.param_groups
        pairs = []
        for g in saved:
            ps = [p for p in g["params"] if id(p) in mine]
            if ps:
                sub = dict(g)
                sub["params"] = ps
                pairs.append((g, sub))
        if not pairs:
            return
        self.optimizer.param_groups = [sub for _, sub in pairs]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = saved
            for g, sub in pairs:  # settings a step may change in its group go back there
                g.update({k: v for k, v in sub.items() if k != "params"})
        self.steps += 1


def _set_grads(params: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    """``p.grad = view`` by value for every parameter, in two foreach calls rather than a copy
    per tensor: after ``zero_grad()`` every ``.grad`` is None, and 161 separate clones cost
    ResNet-50's step about 2.4 ms of host time on the H100 machine."""
    fresh_p, fresh_v, dst, src = [], [], [], []
    for p, v in zip(params, views):
        g = p.grad
        if g is None:
            if v.dtype == p.dtype:
                fresh_p.append(p)
                fresh_v.append(v.detach())
            else:
                p.grad = v.detach().to(p.dtype)
        elif g.data_ptr() != v.data_ptr():
            dst.append(g)
            src.append(v)
    if fresh_v:
        for p, g in zip(fresh_p, torch._foreach_mul(fresh_v, 1.0)):  # exact: new tensors
            p.grad = g
    if dst:
        torch._foreach_copy_(dst, src)


class _Overlap(Wrapper):
    __slots__ = ()

    def reduce(self, state: OverlapState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        params = list(bucket.parameters())
        views = bucket.gradients()
        step = bucket.step
        fut = self.inner.reduce(state.inner, bucket, link)
        stepper = state._stepper

        def run(value: torch.Tensor) -> torch.Tensor:
            if stepper is None:
                raise RuntimeError("aiak.comm.overlap_step: the stepper was lost (unpickled?)")
            vs = views
            if value.data_ptr() != buf.data_ptr():  # a narrower wire of the same length
                vs = _buckets._mirror(views, buf, value.reshape(-1))
            stepper.apply(step, params, vs)
            return value

        return _futures.after(fut, run, buf)


# torch.nn.utils' clip_grad_norm_ / clip_grad_value_: the required parameter of each, the rest
# checked against their signatures
_CLIP_KEYS = {"norm": ({"max_norm"}, {"norm_type"}), "value": ({"clip_value"}, set())}


def overlap_step(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    clip_grad_func: Callable[..., Any] | str | None = None,
    clip_grad_func_params: Mapping[str, Any] | None = None,
    hook: CommHook | None = None,
    offload: bool | None = None,
) -> OverlapStep:
    """Register ``hook`` on ``ddp_model`` so that each bucket's parameters are stepped by
    ``optimizer`` as soon as the bucket is reduced (see the module docstring).

    After ``loss.backward()`` returns, every parameter has been updated: do NOT call
    ``optimizer.step()``; do call ``optimizer.zero_grad()`` before the next backward.
    ``hook`` defaults to :func:`aiak.comm.from_env` (else allreduce); with a DGC hook the
    optimizer must be :class:`aiak.comm.DGCSGD` or momentum-free SGD. ``clip_grad_func``:
    a global clipping function ``f(params, **clip_grad_func_params)`` (``"norm"`` means
    ``torch.nn.utils.clip_grad_norm_``), run when the last bucket arrives.
    ``offload``: run each bucket's hook and step on aiak's worker thread and a side stream
    (see the module docstring); ``None`` follows :func:`aiak.comm.register`'s default.
    """
    from .activate import from_env, register

    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"overlap_step: ddp_model must be DistributedDataParallel, got "
            f"{type(ddp_model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"overlap_step: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "overlap_step: ddp_model already has a comm hook (DDP allows one); pass it as "
            "overlap_step(..., hook=...) instead of registering it"
        )
    if hook is None:
        hook = from_env()
    if hook is None:
        from .allreduce import allreduce

        hook = allreduce()
    check_hook("overlap_step", "hook", hook)
    check_dgc_optimizer(hook, optimizer)
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"overlap_step: offload must be a bool or None, got {offload!r}")
    named = {"norm": torch.nn.utils.clip_grad_norm_, "value": torch.nn.utils.clip_grad_value_}
    if isinstance(clip_grad_func, str) and clip_grad_func not in named:
        raise ValueError(
            f"overlap_step: clip_grad_func must be 'norm', 'value', a callable or None, got "
            f"{clip_grad_func!r}"
        )
    if not (clip_grad_func is None or isinstance(clip_grad_func, str) or callable(clip_grad_func)):
        raise TypeError(f"overlap_step: clip_grad_func must be callable, got {clip_grad_func!r}")
    target = named.get(clip_grad_func) if isinstance(clip_grad_func, str) else None
    clip_grad_func_params = check_clip(
        "overlap_step", clip_grad_func, clip_grad_func_params, _CLIP_KEYS, target
    )
    if target is not None:
        clip_grad_func = target
    module_params = {id(p) for p in ddp_model.module.parameters() if p.requires_grad}
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if module_params != opt_params:
        raise ValueError(
            "overlap_step: the optimizer must hold exactly the DDP module's trainable "
            f"parameters ({len(opt_params)} vs {len(module_params)})"
        )
    wrapped = _Overlap(OverlapState(hook.state), hook)
    stepper = OverlapStep(optimizer, wrapped, clip_grad_func, clip_grad_func_params)
    wrapped.state._stepper = stepper
    register(ddp_model, wrapped, offload=offload)
    return stepper
