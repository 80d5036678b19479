"""Deep Gradient Compression (Lin et al., ICLR 2018) as a composable hook, and its optimizer.

Per bucket, every gradient with ``dim > 1`` is compressed; the others go densely. The work of
one bucket is a fixed number of torch calls, whatever its number of tensors (the bucket's
memory and tables are flat, in the bucket's layout; the layout and its tables are built once):

* local clipping (``clip_grad_func``): ``"norm"`` per tensor by one ``index_add_`` over segment
  ids, ``"value"`` one clamp; a user's callable is called once per tensor;
* momentum correction in the hook's flat memory: ``mmt = m*mmt + g`` (nesterov:
  ``mmt = (mmt+g)*m``) and ``vec += mmt`` (nesterov: ``mmt + g``);
* every compressed tensor's selection in ONE call of ``aiak::dgc_segments_select``: a FIXED
  ``k = ceil(numel * ratio)`` entries per tensor by DGC's reference rules (docs/dgc.md:
  sampling, threshold, adaptation, exact top-k on overshoot; padded with index -1), the
  samples' random starts (or positions) drawn in one generator call: no host synchronisation;
* momentum factor masking: ``vec[idx] = 0`` and (``momentum_masking``) ``mmt[idx] = 0``, one
  ``index_fill_`` each;
* one allgather of the packed (indices, values) bytes of the whole bucket, one averaging
  allreduce of its dense tensors, gathered and scattered by one precomputed index (momentum
  applied locally: averaging is linear, so that is SGD momentum of the mean gradient); the
  result is ``zeros.index_add(idx_all, vals_all) / P``.

The optimizer must be SGD that applies momentum only to weight decay: :class:`DGCSGD`
(``DGCSGD.from_optimizer(torch.optim.SGD(...))``; its code is comm/_dgc_sgd.py). Memory is
fp32, flat per bucket, and pickles per parameter (by name when the hook is registered with
:func:`aiak.comm.register`): ``state.mmt[key]`` / ``state.vec[key]``, ``n + 1`` elements for a
compressed tensor (its last one a dump slot, 0) and ``n`` for a dense one (no ``vec``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _collectives, _futures, _streams
from ._base import CommHook, HookState, Setup
from ._checks import check_dgc_options
from ._collectives import Link
from ._dgc_sgd import DGCSGD, require_sgd

_OPS: list[Any] = []  # aiak.ops's (plan, select), imported on first use (lean import)


def _segments() -> tuple[Callable[..., torch.Tensor], Callable[..., Any]]:
    if not _OPS:
        # comm may use aiak.ops (the foundation); importing it registers the op
        from aiak.ops.dgc_segments import dgc_segments_plan, dgc_segments_select

        _OPS.extend((dgc_segments_plan, dgc_segments_select))
    return _OPS[0], _OPS[1]


__all__ = ["DGCSGD", "DGCState", "check_dgc_optimizer", "dgc", "link_dgc_optimizer"]


class DGCState(HookState):
    __slots__ = (
        "_mem",
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
        # Per-parameter memory, the format that pickles: read by a bucket layout when it is
        # built (its keys then leave these dicts), written back by __getstate__ and by a
        # change of layout. momentum: fp32, +1 dump slot when compressed; vec: the residual.
        self.mmt: dict[str, torch.Tensor] = {}
        self.vec: dict[str, torch.Tensor] = {}
        # run time: per bucket index, its flat memory and tables (_BucketMemory)
        self._mem: dict[int, _BucketMemory] | None = {}

    def export_memory(self) -> None:
        """Write every bucket's flat memory into ``mmt`` / ``vec`` and drop the buckets."""
        sparse = self.ratio() < 1.0
        for mem in (self._mem or {}).values():
            mem.export(self.mmt, self.vec, sparse)
        self._mem = {}

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        # the per-parameter format, without touching the live buckets
        mmt, vec = dict(self.mmt), dict(self.vec)
        sparse = self.ratio() < 1.0
        for mem in (self._mem or {}).values():
            mem.export(mmt, vec, sparse)
        d["mmt"], d["vec"] = mmt, vec
        return d

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


def _signature(buf: torch.Tensor, params: list) -> tuple:
    """What decides a bucket's layout, read without a torch call per tensor."""
    return (buf.numel(), buf.dtype, buf.device, tuple(map(id, params)))


class _Plan:
    """One bucket layout's tables for one ratio (built once, kept on the device)."""

    __slots__ = ("dpos", "kind", "n_rep", "segments", "start_rep", "strides", "table", "zeros")

    def __init__(self, mem: _BucketMemory, ratio: float, state: DGCState) -> None:
        big = [(off, n) for off, n, b in mem.tensors if b and ratio < 1.0]
        dense = [(off, n) for off, n, b in mem.tensors if not b or ratio >= 1.0]
        dev = mem.mmt.device
        self.segments = len(big)
        # "all": the whole buffer goes densely; "some": the positions ``dpos``; "none"
        self.kind = "all" if not big else "some" if dense else "none"
        self.dpos = self.table = self.strides = self.n_rep = self.start_rep = self.zeros = None
        if self.kind == "some":
            pos = [torch.arange(off, off + n, dtype=torch.int64) for off, n in dense]
            self.dpos = torch.cat(pos).to(dev)
        if not big:
            return
        if state.int32_indices and mem.length >= 2**31:
            raise ValueError("dgc: int32_indices with a bucket of 2^31 elements or more")
        plan_fn, _ = _segments()
        plan = plan_fn([n for _, n in big], [off for off, _ in big], ratio, state.sample_ratio)
        self.table = plan.to(dev)
        if state.strided_sample:
            self.strides = plan[:, 6].double()
        else:
            m = plan[:, 4]
            self.n_rep = plan[:, 1].double().repeat_interleave(m)
            self.start_rep = plan[:, 0].repeat_interleave(m)
            self.zeros = torch.zeros(self.segments, dtype=torch.int64, device=dev)

    def samples(
        self, gen: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's random starts (strided) or positions (uniform): one generator call."""
        if self.strides is not None:
            u = torch.rand(self.segments, generator=gen, dtype=torch.float64)
            return u.mul_(self.strides).long().to(device, non_blocking=True), None
        u = torch.rand(self.n_rep.numel(), generator=gen, dtype=torch.float64)
        pos = u.mul_(self.n_rep).long().add_(self.start_rep)
        return self.zeros, pos.to(device, non_blocking=True)


class _BucketMemory:
    """Momentum and residual of one bucket (flat fp32, + a dump slot at ``length``), its
    tensors' places and its tables per ratio."""

    __slots__ = ("_seg", "keys", "length", "mmt", "plans", "sig", "tensors", "vec")

    def __init__(self, sig: tuple, bucket: Any, names: Mapping[Any, str], state: DGCState):
        buf = bucket.buffer()
        base, params = buf.storage_offset(), bucket.parameters()
        self.sig, self.length = sig, buf.numel()
        tensors, keys = [], []
        for i, g in enumerate(bucket.gradients()):
            n = g.numel()
            p = params[i] if i < len(params) else None
            key = names.get(p) if p is not None else None
            keys.append(key or f"{bucket.index()}.{i}.{n}")
            tensors.append((g.storage_offset() - base, n, g.dim() > 1))
        order = sorted(range(len(tensors)), key=lambda i: tensors[i][0])
        self.tensors: list[tuple[int, int, bool]] = [tensors[i] for i in order]
        self.keys: list[str] = [keys[i] for i in order]
        dev = buf.device
        self.mmt = torch.zeros(self.length + 1, dtype=torch.float32, device=dev)
        self.vec = torch.zeros(self.length + 1, dtype=torch.float32, device=dev)
        for key, (off, n, _) in zip(self.keys, self.tensors):
            for flat, saved in ((self.mmt, state.mmt), (self.vec, state.vec)):
                t = saved.pop(key, None)
                if t is not None and t.numel() in (n, n + 1):
                    flat[off : off + n].copy_(t.reshape(-1)[:n])
        self.plans: dict[tuple, _Plan] = {}
        self._seg: torch.Tensor | None = None

    def export(self, mmt: dict, vec: dict, sparse: bool) -> None:
        """Write this bucket's memory into ``mmt`` / ``vec`` (the per-parameter format)."""
        for key, (off, n, big) in zip(self.keys, self.tensors):
            m = self.mmt[off : off + n]
            if big and sparse:
                mmt[key] = torch.cat([m, m.new_zeros(1)])
                vec[key] = torch.cat([self.vec[off : off + n], m.new_zeros(1)])
            else:
                mmt[key] = m.clone()
                vec.pop(key, None)

    def plan(self, ratio: float, state: DGCState) -> _Plan:
        # the settings a plan reads: a state changed between steps gets a new one
        key = (ratio, state.sample_ratio, state.strided_sample, state.int32_indices)
        got = self.plans.get(key)
        if got is None:
            got = self.plans[key] = _Plan(self, ratio, state)
        return got

    def segment_ids(self) -> torch.Tensor:
        """Per element of the buffer, the place of its tensor (gaps: ``len(tensors)``)."""
        if self._seg is None:
            ids, lens, at = [], [], 0
            for i, (off, n, _) in enumerate(self.tensors):
                if off > at:
                    ids.append(len(self.tensors))
                    lens.append(off - at)
                ids.append(i)
                lens.append(n)
                at = off + n
            if at < self.length:
                ids.append(len(self.tensors))
                lens.append(self.length - at)
            seg = torch.tensor(ids, dtype=torch.int32).repeat_interleave(torch.tensor(lens))
            self._seg = seg.to(self.mmt.device)
        return self._seg

    def clip(self, state: DGCState, buf: torch.Tensor) -> None:
        """Local clipping of every tensor of the bucket, in place."""
        fn, params = state.clip_grad_func, state.clip_grad_func_params or {}
        if fn is None:
            return
        if fn == "value":
            v = float(params["clip_value"])
            buf.clamp_(-v, v)
            return
        if fn != "norm":
            for off, n, _ in self.tensors:  # a user's function: one call per tensor
                fn(buf[off : off + n], **params)
            return
        max_norm, p = float(params["max_norm"]), float(params.get("norm_type", 2.0))
        seg = self.segment_ids()
        a = buf.abs().float()
        acc = torch.zeros(len(self.tensors) + 1, dtype=torch.float32, device=buf.device)
        if math.isinf(p):
            with warnings.catch_warnings():  # index_reduce_ says it is beta, once
                warnings.simplefilter("ignore", UserWarning)
                norm = acc.index_reduce_(0, seg, a, "amax")
        else:
            norm = acc.index_add_(0, seg, a.pow_(p)).pow_(1.0 / p)
        # a device-side factor per tensor: no host sync for the comparison
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(buf.dtype)
        buf.mul_(factor.index_select(0, seg))

    def step(self, state: DGCState, buf: torch.Tensor, ratio: float, gen: torch.Generator):
        """Clip, momentum, select and mask. Returns ``(plan, dense values or None, selected
        positions or None, their values)``: positions index the bucket, padding is ``length``
        (the dump slot, value 0); dense values are the plan's ``dpos`` (or the whole buffer)."""
        plan = self.plan(ratio, state)
        self.clip(state, buf)
        length, m = self.length, state.momentum
        body = self.mmt[:length]
        if state.nesterov:
            body.add_(buf).mul_(m)
        else:
            body.mul_(m).add_(buf)
        # fp16_values halves the dense allreduce too, as DGC's reference does
        ddtype = torch.float16 if state.fp16_values else buf.dtype
        dense = None
        if plan.kind == "all":
            dense = body.add(buf).to(ddtype) if state.nesterov else body.to(ddtype, copy=True)
            return plan, dense, None, None
        if plan.kind == "some":
            dense = body.index_select(0, plan.dpos)
            if state.nesterov:
                dense.add_(buf.index_select(0, plan.dpos))
            dense = dense.to(ddtype)
        vec = self.vec[:length]
        vec.add_(body)
        if state.nesterov:
            vec.add_(buf)
        if plan.dpos is not None:
            vec.index_fill_(0, plan.dpos, 0.0)  # dense tensors keep no residual
        start, where = plan.samples(gen, buf.device)
        _, select = _segments()
        vals, idx = select(
            self.vec, plan.table, start, where, state.compress_upper_bound,
            state.compress_lower_bound, state.max_adaptation_iters, state.resample,
        )  # fmt: skip
        idx = torch.where(idx < 0, length, idx)
        self.vec.index_fill_(0, idx, 0.0)  # the dump slot stays 0
        if state.momentum_masking:
            self.mmt.index_fill_(0, idx, 0.0)
        return plan, dense, idx, vals


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
        length = buf.numel()
        if state._mem is None:
            state._mem = {}
        sig = _signature(buf, bucket.parameters())
        mem = state._mem.get(bucket.index())
        if mem is None or mem.sig != sig:
            if mem is not None:  # a new layout: every bucket re-reads the per-key memory
                state.export_memory()
            mem = _BucketMemory(sig, bucket, state._names or {}, state)
            state._mem[bucket.index()] = mem
        world = link.size
        gen = torch.Generator().manual_seed(
            (state.seed * 1_000_003 + bucket.step) * 7919 + bucket.index()
        )
        plan, dense, idx, vals = mem.step(state, buf, state.ratio(), gen)
        futs = []
        if dense is not None:
            futs.append(_futures.real(_collectives.all_reduce_mean(dense, link, state.traffic)))
        if idx is not None:
            vdtype = torch.float16 if state.fp16_values else torch.float32
            idtype = torch.int32 if state.int32_indices else torch.int64
            # indices first: both views then start at a multiple of their element size
            icat, vcat = idx.to(idtype), vals.to(vdtype)
            nib = icat.numel() * icat.element_size()
            payload = torch.cat([icat.view(torch.uint8), vcat.view(torch.uint8)])
            gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
            futs.append(
                _futures.real(_collectives.all_gather(gathered, payload, link, state.traffic))
            )

        def decode(done: list[torch.futures.Future]) -> torch.Tensor:
            for f in done:
                f.value()  # re-raises a failed collective
            if idx is not None:
                _streams.keep(gathered)
                rows = gathered.view(world, -1)
                i_all = rows[:, :nib].reshape(-1).view(idtype)
                v_all = rows[:, nib:].reshape(-1).view(vdtype)
                acc = torch.zeros(length + 1, dtype=torch.float32, device=buf.device)
                acc.index_add_(0, i_all, v_all.float())
                buf.copy_(acc[:length].div_(world))
            if dense is not None:
                _streams.keep(dense)
                if plan.kind == "all":
                    buf.copy_(dense)
                else:
                    buf.index_copy_(0, plan.dpos, dense.to(buf.dtype))
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
