"""Deep Gradient Compression (Lin et al., ICLR 2018) as a composable hook, and its optimizer.

Per bucket, every gradient with ``dim > 1`` is compressed; the others go densely:

* local clipping (``clip_grad_func``: ``"norm"``, ``"value"`` or a callable, per tensor);
* momentum correction in the hook's memory: ``mmt = m*mmt + g`` (nesterov: ``mmt = (mmt+g)*m``)
  and ``vec += mmt`` (nesterov: ``mmt + g``);
* selection of a FIXED ``k = ceil(numel * ratio)`` entries of ``vec`` by ``aiak::dgc_select``
  (sample, threshold, adapt, compact; padded with index -1): no host synchronisation;
* momentum factor masking: ``vec[idx] = 0`` and (``momentum_masking``) ``mmt[idx] = 0``;
* one allgather of the packed (values, indices) bytes of the whole bucket, one averaging
  allreduce of its dense tensors (momentum applied locally: averaging is linear, so that is
  SGD momentum of the mean gradient); the result is ``zeros.index_add(idx_all, vals_all)/P``.

The optimizer must be SGD that applies momentum only to weight decay: :class:`DGCSGD`
(``DGCSGD.from_optimizer(torch.optim.SGD(...))``; its code is comm/_dgc_sgd.py). Memory is
kept per parameter (by name when the hook is registered with :func:`aiak.comm.register`), in
fp32, and pickles with the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _collectives, _futures, _streams
from ._base import CommHook, HookState, Setup
from ._checks import check_dgc_options
from ._collectives import Link
from ._dgc_sgd import DGCSGD, require_sgd

_SELECT: list[Any] = []  # aiak.ops's selection op, imported on first use (lean import)


def _selector() -> Any:
    if not _SELECT:
        try:  # comm may use aiak.ops when it is installed (the selection kernel)
            from aiak.ops.dgc_select import dgc_select
        except ImportError:  # pragma: no cover - aiak.ops ships with aiak
            dgc_select = None
        _SELECT.append(dgc_select)
    return _SELECT[0]


__all__ = ["DGCSGD", "DGCState", "check_dgc_optimizer", "dgc", "link_dgc_optimizer"]


class DGCState(HookState):
    __slots__ = (
        "awaits_optimizer",
        "clip_grad_func",
        "clip_grad_func_params",
        "compress_lower_bound",
        "compress_ratio",
        "compress_upper_bound",
        "epoch",
        "fp16_values",
        "int32_indices",
        "max_adaptation_iters",
        "mmt",
        "momentum",
        "momentum_masking",
        "nesterov",
        "resample",
        "sample_ratio",
        "seed",
        "strided_sample",
        "vec",
        "warmup_coeff",
        "warmup_epochs",
    )

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        for name, value in kw.items():
            setattr(self, name, value)
        self.epoch = 0
        self.seed = 0
        # True for a hook built from AIAK_DGC=1: its momentum comes from the SGD optimizer
        # (link_dgc_optimizer); exchanging gradients before that would use a guessed momentum.
        self.awaits_optimizer = False
        self.mmt: dict[str, torch.Tensor] = {}  # momentum per parameter (fp32, +1 dump slot)
        self.vec: dict[str, torch.Tensor] = {}  # accumulated residual per parameter

    def set_epoch(self, epoch: int) -> None:
        """The epoch the warm-up schedule reads (call it at the start of every epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"DGCState.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def ratio(self) -> float:
        """The compress ratio of the current epoch (warm-up: denser first epochs)."""
        r, w, e = self.compress_ratio, self.warmup_epochs, self.epoch
        if w > 0 and e < w:
            if isinstance(self.warmup_coeff, (list, tuple)):
                return float(self.warmup_coeff[e])
            coeff = self.warmup_coeff if self.warmup_coeff is not None else r ** (1.0 / (w + 1))
            return max(coeff ** (e + 1), r)
        return r


def _clip(state: DGCState, g: torch.Tensor) -> None:
    fn, params = state.clip_grad_func, state.clip_grad_func_params or {}
    if fn is None:
        return
    if fn == "value":
        v = float(params["clip_value"])
        g.clamp_(-v, v)
    elif fn == "norm":
        max_norm = float(params["max_norm"])
        norm = torch.linalg.vector_norm(g, float(params.get("norm_type", 2.0)))
        # a device-side factor: no host sync for the comparison
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(g.dtype))
    else:
        fn(g, **params)


def _select(
    state: DGCState, v: torch.Tensor, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    n = v.numel()
    if k >= n:
        return v.clone(), torch.arange(n, device=v.device)
    m = min(n, max(1, math.ceil(n * state.sample_ratio)))
    _dgc_select = _selector()
    if _dgc_select is None:  # aiak.ops absent: exact top-k, the same fixed-k contract
        idx = torch.topk(v.abs(), k, sorted=False).indices.sort().values
        return v[idx], idx
    if state.strided_sample:
        stride = max(1, n // m)
        start = int(torch.randint(0, stride, (1,), generator=gen))
        return _dgc_select(
            v, k, m, start, stride, None, state.compress_upper_bound,
            state.compress_lower_bound, state.max_adaptation_iters, state.resample,
        )  # fmt: skip
    samples = torch.randint(0, n, (m,), generator=gen).to(v.device, non_blocking=True)
    return _dgc_select(
        v, k, m, 0, 1, samples, state.compress_upper_bound, state.compress_lower_bound,
        state.max_adaptation_iters, state.resample,
    )  # fmt: skip


class _DGC(CommHook):
    __slots__ = ()

    def setup_tree(self, state: HookState, ctx: Setup) -> None:
        state._names = ctx.names

    def reduce(self, state: DGCState, bucket: Any, link: Link) -> torch.futures.Future:
        if state.awaits_optimizer:
            raise RuntimeError(
                "dgc: this hook was built from AIAK_DGC=1 and no SGD optimizer was linked to it "
                "before the first backward: DGC supports SGD only and takes its momentum from "
                "it. Build torch.optim.SGD over the model's parameters (aiakrun --dgc swaps it "
                "for DGCSGD) or call aiak.comm.link_dgc_optimizer(hook, optimizer)"
            )
        buf = bucket.buffer()
        length, base = buf.numel(), buf.storage_offset()
        names = state._names or {}
        world = link.size
        ratio = state.ratio()
        m = state.momentum
        params = bucket.parameters()
        dense: list[tuple[int, torch.Tensor]] = []
        vals: list[torch.Tensor] = []
        idxs: list[torch.Tensor] = []
        gen = torch.Generator().manual_seed(
            (state.seed * 1_000_003 + bucket.step) * 7919 + bucket.index()
        )
        for i, g in enumerate(bucket.gradients()):
            n = g.numel()
            off = g.storage_offset() - base
            flat = buf[off : off + n]  # the view's memory, in its layout (channels_last too)
            _clip(state, flat)
            p = params[i] if i < len(params) else None
            key = names.get(p) if p is not None else None
            key = key or f"{bucket.index()}.{i}.{n}"
            sparse = g.dim() > 1 and ratio < 1.0
            size = n + 1 if sparse else n  # sparse memory: one dump slot for padded indices
            mmt = state.mmt.get(key)
            if mmt is None or mmt.numel() != size or mmt.device != buf.device:
                mmt = state.mmt[key] = torch.zeros(size, dtype=torch.float32, device=buf.device)
                state.vec.pop(key, None)
            body = mmt[:n]
            if state.nesterov:
                body.add_(flat).mul_(m)
            else:
                body.mul_(m).add_(flat)
            if not sparse:
                out = body + flat if state.nesterov else body
                dense.append((off, out))
                continue
            vec = state.vec.get(key)
            if vec is None:
                vec = state.vec[key] = torch.zeros(size, dtype=torch.float32, device=buf.device)
            vec[:n].add_(body)
            if state.nesterov:
                vec[:n].add_(flat)
            k = min(n, max(1, math.ceil(n * ratio)))
            v, idx = _select(state, vec[:n], k, gen)
            dump = torch.where(idx < 0, n, idx)
            vec.index_fill_(0, dump, 0.0)
            if state.momentum_masking:
                mmt.index_fill_(0, dump, 0.0)
            vals.append(v)
            idxs.append(torch.where(idx < 0, length, idx + off))  # bucket offsets; dump = end

        futs = []
        if dense:
            dbuf = torch.cat([t.reshape(-1) for _, t in dense]).to(buf.dtype)
            futs.append(_futures.real(_collectives.all_reduce_mean(dbuf, link, state.traffic)))
        if vals:
            vdtype = torch.float16 if state.fp16_values else torch.float32
            idtype = torch.int32 if state.int32_indices else torch.int64
            if state.int32_indices and length >= 2**31:
                raise ValueError("dgc: int32_indices with a bucket of 2^31 elements or more")
            vcat = torch.cat(vals).to(vdtype)
            icat = torch.cat(idxs).to(idtype)
            nvb = vcat.numel() * vcat.element_size()
            payload = torch.cat([vcat.view(torch.uint8), icat.view(torch.uint8)])
            gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
            futs.append(
                _futures.real(_collectives.all_gather(gathered, payload, link, state.traffic))
            )

        def decode(done: list[torch.futures.Future]) -> torch.Tensor:
            for f in done:
                f.value()  # re-raises a failed collective
            if vals:
                _streams.keep(gathered)
                rows = gathered.view(world, -1)
                v_all = rows[:, :nvb].contiguous().view(vdtype).reshape(-1)
                i_all = rows[:, nvb:].contiguous().view(idtype).reshape(-1).long()
                acc = torch.zeros(length + 1, dtype=torch.float32, device=buf.device)
                acc.index_add_(0, i_all, v_all.float())
                buf.copy_(acc[:length].div_(world))
            else:
                buf.zero_()
            if dense:
                _streams.keep(dbuf)
                o = 0
                for off, t in dense:
                    buf[off : off + t.numel()].copy_(dbuf[o : o + t.numel()])
                    o += t.numel()
            return buf

        return _futures.after(torch.futures.collect_all(futs), decode, buf)


def dgc(
    compress_ratio: float = 0.001,
    sample_ratio: float = 0.01,
    strided_sample: bool = True,
    compress_upper_bound: float = 1.3,
    compress_lower_bound: float = 0.8,
    max_adaptation_iters: int = 10,
    resample: bool = True,
    fp16_values: bool = False,
    int32_indices: bool = False,
    warmup_epochs: int = -1,
    warmup_coeff: float | Sequence[float] | None = None,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_masking: bool = True,
    clip_grad_func: str | Callable[..., Any] | None = None,
    clip_grad_func_params: Mapping[str, Any] | None = None,
) -> CommHook:
    """Deep Gradient Compression (see the module docstring).

    ``warmup_epochs`` > 0: during epoch ``e < warmup_epochs`` (``hook.state.set_epoch(e)``) the
    ratio is ``warmup_coeff[e]`` (a list) or ``max(coeff**(e+1), compress_ratio)`` with
    ``coeff = warmup_coeff`` or ``compress_ratio**(1/(warmup_epochs+1))``.
    ``clip_grad_func``: ``"norm"`` (params ``max_norm``, ``norm_type``; the paper's local rule
    is ``max_norm = global_max_norm / sqrt(world)``), ``"value"`` (``clip_value``) or a callable
    ``f(flat_grad, **params)`` clipping in place; applied per tensor before momentum.
    Use it with :class:`DGCSGD` (momentum lives here; the optimizer's only on weight decay).
    """
    # every argument, checked and normalised; locals() holds exactly the arguments here
    state = DGCState(**check_dgc_options(**locals()))
    return _DGC(state)


def _dgc_states(state: HookState) -> list[DGCState]:
    out, stack = [], [state]
    while stack:
        s = stack.pop()
        if isinstance(s, DGCState):
            out.append(s)
        stack.extend(s.children())
    return out


def check_dgc_optimizer(hook: CommHook, optimizer: torch.optim.Optimizer) -> None:
    """Raise when ``hook`` contains DGC and ``optimizer`` cannot go with it.

    Allowed: :class:`DGCSGD`, or SGD without momentum (torch's or aiak's FusedSGD). Another
    optimizer: ``TypeError``; SGD with momentum: ``ValueError`` (momentum would apply twice).
    """
    states = _dgc_states(hook.state)
    if not states:
        return
    require_sgd(optimizer)
    if isinstance(optimizer, DGCSGD):
        return
    if any(g.get("momentum", 0) for g in optimizer.param_groups) and any(
        s.momentum for s in states
    ):
        raise ValueError(
            "DGC applies momentum in its memory; an SGD with momentum would apply it twice: "
            "use aiak.comm.DGCSGD.from_optimizer(optimizer)"
        )


def link_dgc_optimizer(hook: CommHook, optimizer: torch.optim.Optimizer) -> None:
    """Give the DGC in ``hook`` the momentum (and nesterov) of ``optimizer``.

    For a hook built from the environment (``AIAK_DGC=1``), whose momentum is the optimizer's.
    ``optimizer``: :class:`DGCSGD` (its groups' momentum then applies to weight decay only),
    or SGD without momentum. Every group must have the same momentum and nesterov.
    """
    states = _dgc_states(hook.state)
    if not states:
        raise ValueError("link_dgc_optimizer: hook contains no DGC")
    require_sgd(optimizer)
    settings = {
        (float(g.get("momentum", 0.0)), bool(g.get("nesterov", False)))
        for g in optimizer.param_groups
    }
    if len(settings) != 1:
        raise ValueError(
            f"link_dgc_optimizer: the optimizer's groups differ in momentum/nesterov "
            f"{sorted(settings)}; DGC keeps one momentum in its memory"
        )
    ((m, nesterov),) = settings
    if m and not isinstance(optimizer, DGCSGD):
        raise ValueError(
            "link_dgc_optimizer: an SGD with momentum would apply it twice: link "
            "aiak.comm.DGCSGD.from_optimizer(optimizer) instead"
        )
    for s in states:
        s.momentum, s.nesterov, s.awaits_optimizer = m, nesterov, False
