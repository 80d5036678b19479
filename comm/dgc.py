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
* one allgather of the packed (indices, values) bytes of the whole bucket; its dense tensors,
  gathered and scattered by one precomputed index, ride in the same allgather when they are at
  most the sparse payload's size (averaged on arrival), else go by one averaging allreduce
  (momentum applied locally: averaging is linear, so that is SGD momentum of the mean
  gradient); the result is ``zeros.index_add(idx_all, vals_all) / P``.

The optimizer must be SGD that applies momentum only to weight decay: :class:`DGCSGD`
(``DGCSGD.from_optimizer(torch.optim.SGD(...))``; its code is comm/_dgc_sgd.py). Memory is
fp32, flat per bucket (comm/_dgc_bucket.py: the memory, its tables and the bucket's step),
and pickles per parameter (by name when the hook is registered with
:func:`aiak.comm.register`): ``state.mmt[key]`` / ``state.vec[key]``, ``n + 1`` elements for a
compressed tensor (its last one a dump slot, 0) and ``n`` for a dense one (no ``vec``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _collectives, _futures, _streams
from ._base import CommHook, HookState, Setup
from ._checks import check_dgc_options
from ._collectives import Link
from ._dgc_bucket import BucketMemory, signature
from ._dgc_sgd import DGCSGD, require_sgd

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
        # run time: per bucket index, its flat memory and tables (comm/_dgc_bucket.py)
        self._mem: dict[int, BucketMemory] | None = {}

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
        sig = signature(buf, bucket.parameters())
        mem = state._mem.get(bucket.index())
        if mem is None or mem.sig != sig:
            if mem is not None:  # a new layout: every bucket re-reads the per-key memory
                state.export_memory()
            mem = BucketMemory(sig, bucket, state._names or {}, state)
            state._mem[bucket.index()] = mem
        world = link.size
        gen = torch.Generator().manual_seed(
            (state.seed * 1_000_003 + bucket.step) * 7919 + bucket.index()
        )
        plan, dense, idx, vals = mem.step(state, buf, state.ratio(), gen)
        futs = []
        vdtype = torch.float16 if state.fp16_values else torch.float32
        idtype = torch.int32 if state.int32_indices else torch.int64
        # The dense tensors ride in the allgather when they are at most its sparse payload's
        # size (biases and norms beside convolutions and matrices): one collective per bucket
        # instead of two, each a round of latency on a slow transport, for at most twice the
        # allgather's bytes. Larger dense parts (a ratio-1 epoch, a bucket of vectors) go by
        # their own averaging allreduce, which sends 2(P-1)/P of them instead of (P-1).
        merged = (
            dense is not None
            and idx is not None
            and dense.numel() * dense.element_size()
            <= idx.numel() * (idtype.itemsize + vdtype.itemsize)
        )
        if dense is not None and not merged:
            futs.append(_futures.real(_collectives.all_reduce_mean(dense, link, state.traffic)))
        if idx is not None:
            # indices first, then values, then (merged) the dense values: every view starts
            # at a multiple of its element size
            icat, vcat = idx.to(idtype), vals.to(vdtype)
            nib = icat.numel() * icat.element_size()
            nvb = nib + vcat.numel() * vcat.element_size()
            parts = [icat.view(torch.uint8), vcat.view(torch.uint8)]
            if merged:
                parts.append(dense.view(torch.uint8))
            payload = torch.cat(parts)
            gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
            futs.append(
                _futures.real(_collectives.all_gather(gathered, payload, link, state.traffic))
            )
            # Made here, on the hook's stream, not in the callback: on CUDA the callback runs
            # on a pooled stream, a different one each time, and the caching allocator keeps
            # blocks per stream, so a bucket-sized buffer made there misses the cache (cudaMalloc).
            acc = torch.zeros(length + 1, dtype=torch.float32, device=buf.device)

        def decode(_: torch.Tensor) -> torch.Tensor:
            if idx is not None:
                _streams.keep(gathered, acc)
                rows = gathered.view(world, -1)
                i_all = rows[:, :nib].reshape(-1).view(idtype)
                v_all = rows[:, nib:nvb].reshape(-1).view(vdtype)
                acc.index_add_(0, i_all, v_all.float())
                buf.copy_(acc[:length].div_(world))
                if merged:  # every rank's dense values: their mean, summed in fp32
                    d_all = rows[:, nvb:].contiguous().view(dense.dtype).float()
                    mean = d_all.sum(0).div_(world)
                    buf.index_copy_(0, plan.dpos, mean.to(buf.dtype))
            if dense is not None and not merged:
                _streams.keep(dense)
                if plan.kind == "all":
                    buf.copy_(dense)
                else:
                    buf.index_copy_(0, plan.dpos, dense.to(buf.dtype))
            return buf

        # one future for both collectives, whose callback's stream waited for both
        return _futures.after(_futures.all_of(futs, buf), decode, buf)


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
