"""Deep Gradient Compression (Lin et al., ICLR 2018) as a composable hook, and its optimizer.

Per bucket, every gradient with ``dim > 1`` is compressed; the others go densely:

* local clipping (``clip_grad_func``: ``"norm"``, ``"value"`` or a callable, per tensor);
* momentum correction in the hook's memory: ``mmt = m*mmt + g`` (nesterov: ``mmt = (mmt+g)*m``)
  and ``vec += mmt`` (nesterov: ``mmt + g``);
* selection of a FIXED ``k = ceil(numel * ratio)`` entries of ``vec`` per tensor, by the
  sampling and threshold rules of DGC's reference code (padded with index -1): no host sync;
* momentum factor masking: ``vec[idx] = 0`` and (``momentum_masking``) ``mmt[idx] = 0``;
* one allgather of the packed (indices, values) bytes of the whole bucket, one averaging
  allreduce of its dense tensors (momentum applied locally: averaging is linear, so that is
  SGD momentum of the mean gradient; fp16 with ``fp16_values``); the result is
  ``zeros.index_add(idx_all, vals_all)/P``.

All of it runs over the bucket's flat buffer in a fixed number of torch launches, whatever the
number of tensors (comm/_dgc_bucket.py: memory and the step; aiak.ops.dgc_bucket: selection).

The optimizer must be SGD that applies momentum only to weight decay: :class:`DGCSGD`
(``DGCSGD.from_optimizer(torch.optim.SGD(...))``; its code is comm/_dgc_sgd.py). Memory is
fp32, flat per bucket, and pickles per parameter (by name when the hook is registered with
:func:`aiak.comm.register`) with the state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _collectives, _dgc_bucket, _futures, _streams
from ._base import CommHook, HookState, Setup
from ._collectives import Link
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
        "cuda_graphs",
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
        # On CUDA each bucket's selection is one CUDA graph replay (aiak.ops.dgc_bucket);
        # False runs its ~190 torch calls one by one (same results).
        self.cuda_graphs = True
        # True for a hook built from AIAK_DGC=1: its momentum comes from the SGD optimizer
        # (link_dgc_optimizer); exchanging gradients before that would use a guessed momentum.
        self.awaits_optimizer = False
        self.mmt: dict[str, torch.Tensor] = {}  # momentum per parameter (fp32, +1 dump slot)
        self.vec: dict[str, torch.Tensor] = {}  # accumulated residual per parameter
        # run time: per bucket index, its flat memory (comm/_dgc_bucket.py); mmt / vec hold
        # the per-key copy that pickles and that a new bucket layout reads
        self._mem: dict[int, _dgc_bucket.BucketMemory] | None = {}

    def export_memory(self) -> None:
        """Write every bucket's flat memory into ``mmt`` / ``vec`` and drop the buckets."""
        sparse = self.ratio() < 1.0
        for mem in (self._mem or {}).values():
            mem.export(self, sparse)
        self._mem = {}

    def __getstate__(self) -> dict[str, Any]:
        self.export_memory()
        return super().__getstate__()

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
        params = bucket.parameters()
        if state._mem is None:
            state._mem = {}
        sig = _dgc_bucket.signature(buf, params)
        mem = state._mem.get(bucket.index())
        if mem is None or mem.sig != sig:
            state.export_memory()  # a new layout: every bucket re-reads the per-key memory
            mem = _dgc_bucket.BucketMemory(sig, bucket, state._names or {}, state)
            state._mem[bucket.index()] = mem
        world = link.size
        gen = torch.Generator().manual_seed(
            (state.seed * 1_000_003 + bucket.step) * 7919 + bucket.index()
        )
        ddense, dpos, idx, vals = mem.step(state, buf, state.ratio(), gen)
        dense = ddense is not None
        sparse = idx is not None
        futs = []
        vdtype = torch.float16 if state.fp16_values else torch.float32
        if dense:  # fp16_values halves the dense allreduce too, as DGC's reference does
            dbuf = ddense.to(torch.float16 if state.fp16_values else buf.dtype)
            futs.append(_futures.real(_collectives.all_reduce_mean(dbuf, link, state.traffic)))
        if sparse:
            idtype = torch.int32 if state.int32_indices else torch.int64
            if state.int32_indices and length >= 2**31:
                raise ValueError("dgc: int32_indices with a bucket of 2^31 elements or more")
            vcat = vals.to(vdtype)
            icat = idx.to(idtype)
            # indices first: both views then start at a multiple of their element size, also
            # where one rank's row needs no copy (world 1)
            nib = icat.numel() * icat.element_size()
            payload = torch.cat([icat.view(torch.uint8), vcat.view(torch.uint8)])
            gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
            futs.append(
                _futures.real(_collectives.all_gather(gathered, payload, link, state.traffic))
            )

        def decode(done: list[torch.futures.Future]) -> torch.Tensor:
            for f in done:
                f.value()  # re-raises a failed collective
            if sparse:
                _streams.keep(gathered)
                rows = gathered.view(world, -1)
                i_all = rows[:, :nib].reshape(-1).view(idtype).long()
                v_all = rows[:, nib:].reshape(-1).view(vdtype)
                acc = torch.zeros(length + 1, dtype=torch.float32, device=buf.device)
                acc.index_add_(0, i_all, v_all.float())
                buf.copy_(acc[:length].div_(world))
            else:
                buf.zero_()
            if dense:
                _streams.keep(dbuf)
                if dpos is None:
                    buf.copy_(dbuf)
                else:
                    buf.index_copy_(0, dpos, dbuf.to(buf.dtype))
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
    """Deep Gradient Compression (the seed's parameters and defaults; see the module docstring).

    ``warmup_epochs`` > 0: during epoch ``e < warmup_epochs`` (``hook.state.set_epoch(e)``) the
    ratio is ``warmup_coeff[e]`` (a list) or ``max(coeff**(e+1), compress_ratio)`` with
    ``coeff = warmup_coeff`` or ``compress_ratio**(1/(warmup_epochs+1))``.
    ``clip_grad_func``: ``"norm"`` (params ``max_norm``, ``norm_type``; the paper's local rule
    is ``max_norm = global_max_norm / sqrt(world)``), ``"value"`` (``clip_value``) or a callable
    ``f(flat_grad, **params)`` clipping in place; applied per tensor before momentum.
    Use it with :class:`DGCSGD` (momentum lives here; the optimizer's only on weight decay).
    """
    for name, v in (("compress_ratio", compress_ratio), ("sample_ratio", sample_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"dgc: {name} must be a number in (0, 1], got {v!r}")
    if not compress_upper_bound > 1:
        raise ValueError(f"dgc: compress_upper_bound must be > 1, got {compress_upper_bound}")
    if not 0 < compress_lower_bound < 1:
        raise ValueError(f"dgc: compress_lower_bound must be in (0, 1), got {compress_lower_bound}")
    if isinstance(max_adaptation_iters, bool) or not isinstance(max_adaptation_iters, int):
        raise TypeError("dgc: max_adaptation_iters must be an int")
    if not 0 <= max_adaptation_iters <= 20:
        raise ValueError(f"dgc: max_adaptation_iters must be in 0..20, got {max_adaptation_iters}")
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int):
        raise TypeError("dgc: warmup_epochs must be an int (-1: no warm-up)")
    if isinstance(warmup_coeff, (list, tuple)):
        if len(warmup_coeff) < warmup_epochs or not all(0 < c <= 1 for c in warmup_coeff):
            raise ValueError(
                f"dgc: warmup_coeff as a list needs {warmup_epochs} ratios in (0, 1], got "
                f"{list(warmup_coeff)}"
            )
        warmup_coeff = [float(c) for c in warmup_coeff]
    elif warmup_coeff is not None and not 0 < warmup_coeff <= 1:
        raise ValueError(f"dgc: warmup_coeff must be in (0, 1], a list, or None: {warmup_coeff}")
    if not 0 <= momentum < 1:
        raise ValueError(f"dgc: momentum must be in [0, 1), got {momentum}")
    if clip_grad_func not in (None, "norm", "value") and not callable(clip_grad_func):
        raise ValueError(
            f"dgc: clip_grad_func must be 'norm', 'value', a callable or None, got "
            f"{clip_grad_func!r}"
        )
    params = dict(clip_grad_func_params or {})
    if clip_grad_func == "norm" and not float(params.get("max_norm", -1)) > 0:
        raise ValueError("dgc: clip_grad_func='norm' needs clip_grad_func_params['max_norm'] > 0")
    if clip_grad_func == "value" and not float(params.get("clip_value", -1)) > 0:
        raise ValueError(
            "dgc: clip_grad_func='value' needs clip_grad_func_params['clip_value'] > 0"
        )
    state = DGCState(
        compress_ratio=float(compress_ratio),
        sample_ratio=float(sample_ratio),
        strided_sample=bool(strided_sample),
        compress_upper_bound=float(compress_upper_bound),
        compress_lower_bound=float(compress_lower_bound),
        max_adaptation_iters=max_adaptation_iters,
        resample=bool(resample),
        fp16_values=bool(fp16_values),
        int32_indices=bool(int32_indices),
        warmup_epochs=warmup_epochs,
        warmup_coeff=warmup_coeff,
        momentum=float(momentum),
        nesterov=bool(nesterov),
        momentum_masking=bool(momentum_masking),
        clip_grad_func=clip_grad_func,
        clip_grad_func_params=params,
    )
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
