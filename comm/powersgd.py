"""Layer-wise PowerSGD (Vogels et al., 2019) as a composable hook.

The math is torch's ``powerSGD_hook`` (its ``_orthogonalize`` and ``_should_compress`` are
reused): per 2-D gradient ``M`` (n x m) with rank r, send ``P = M Q`` (n x r), orthogonalise the
averaged P, send ``Q = M^T P`` (m x r), rebuild ``P Q^T``; vectors and matrices too small to
gain ``min_compression_rate`` go uncompressed. Two differences, both for composition:

* the chain never blocks a worker thread (torch's callbacks ``.wait()`` on a nested allreduce),
  and the uncompressed tensors travel in the same allreduce as the Ps (one round trip less);
* it only needs ``bucket.gradients()`` to be views of ``bucket.buffer()``, so it also runs on
  the row-aligned shard views ``hierarchical`` gives its outer hook.

torch's batched hook is not used: it fails an internal assertion on some torch releases.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize,
    _should_compress,
)

from . import _collectives, _futures, _streams
from ._base import CommHook, HookState
from ._collectives import Link

__all__ = ["PowerSGDState", "powersgd"]


class PowerSGDState(HookState):
    __slots__ = (
        # hyper-parameters
        "eps",
        # internal state, per bucket index (DDP's indices are stable after its first step)
        "error",
        "error_feedback",
        "iter",
        "min_compression_rate",
        "q",
        "rank",
        "seed",
        "start_iter",
        "warm_start",
    )

    def __init__(
        self,
        rank: int,
        start_iter: int,
        min_compression_rate: float,
        error_feedback: bool,
        warm_start: bool,
        seed: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.eps = eps
        self.iter = 0  # steps seen (the top-level hook counts them)
        self.error: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}


class _PowerSGD(CommHook):
    __slots__ = ()
    defers = True  # the Q allreduce is launched from the P allreduce's callback

    def reduce(self, state: PowerSGDState, bucket: Any, link: Link) -> torch.futures.Future:
        buf = bucket.buffer()
        # The step comes from the top-level hook (bucket.step), identical on every rank.
        state.iter = bucket.step + 1
        if bucket.step < state.start_iter or link.size == 1:
            return _collectives.all_reduce_mean(buf, link, state.traffic)
        idx = bucket.index()
        before = None
        if state.error_feedback:
            err = state.error.get(idx)
            if err is not None and err.shape == buf.shape:
                buf.add_(err)
            before = buf.clone()

        mats, plain = [], []
        for g in bucket.gradients():
            m = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
            r = min(m.shape[0], m.shape[1], state.rank)
            if m.numel() and _should_compress(*m.shape, r, state.min_compression_rate)[0]:
                mats.append((m, r))
            else:
                plain.append(g)
        q_len = sum(m.shape[1] * r for m, r in mats)
        qmem = state.q.get(idx) if state.warm_start else None
        if qmem is None or qmem.numel() != q_len or qmem.device != buf.device:
            # Same seed on every rank -> the same Q everywhere, which P = sum(M_i Q) needs.
            gen = torch.Generator().manual_seed(state.seed * 1_000_003 + idx * 7919 + bucket.step)
            qmem = torch.randn(q_len, generator=gen).to(buf.device, buf.dtype)
        qs, off = [], 0
        for m, r in mats:
            qs.append(qmem[off : off + m.shape[1] * r].view(m.shape[1], r))
            off += m.shape[1] * r
        for q in qs:
            _orthogonalize(q.unsqueeze(0), state.eps)

        n_plain = sum(g.numel() for g in plain)
        payload = torch.empty(
            n_plain + sum(m.shape[0] * r for m, r in mats), dtype=buf.dtype, device=buf.device
        )
        if plain:
            torch.cat([g.reshape(-1) for g in plain], out=payload[:n_plain])
        ps, off = [], n_plain
        for (m, r), q in zip(mats, qs):
            p = payload[off : off + m.shape[0] * r].view(m.shape[0], r)
            torch.matmul(m, q, out=p)
            ps.append(p)
            off += m.shape[0] * r

        def compute_qs(_: Any) -> torch.futures.Future:
            _streams.keep(payload, qmem)  # read here, on this callback's stream
            o = 0
            for g in plain:
                g.copy_(payload[o : o + g.numel()].view_as(g))
                o += g.numel()
            for p in ps:
                _orthogonalize(p.unsqueeze(0), state.eps)
            for (m, _r), p, q in zip(mats, ps, qs):
                torch.matmul(m.t(), p, out=q)
            fut = _collectives.all_reduce_mean(qmem, link, state.traffic)
            return _futures.after(fut, decompress, buf)

        def decompress(_: Any) -> torch.Tensor:
            _streams.keep(payload, qmem, *([before] if before is not None else []))
            for (m, _r), p, q in zip(mats, ps, qs):
                torch.matmul(p, q.t(), out=m)
            if before is not None:
                state.error[idx] = before.sub_(buf)
            if state.warm_start:
                state.q[idx] = qmem
            return buf

        fut = _collectives.all_reduce_mean(payload, link, state.traffic)
        return _futures.after(fut, compute_qs, buf, chain=True)


def powersgd(
    rank: int = 1,
    start_iter: int = 1000,
    min_compression_rate: float = 2,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    eps: float = 1e-8,
) -> CommHook:
    """PowerSGD with matrix-approximation ``rank``; plain allreduce for ``start_iter`` steps.

    With error feedback or warm start, ``start_iter`` must be > 1: DDP rebuilds its buckets
    after the first step, so per-bucket memory from step 0 would not match (torch's rule too).
    ``eps`` keeps the orthogonalisation finite when a layer's gradient is all zeros.
    """
    for name, v in (("rank", rank), ("start_iter", start_iter), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"powersgd: {name} must be an int, got {type(v).__name__}")
    for name, v in (("error_feedback", error_feedback), ("warm_start", warm_start)):
        if not isinstance(v, bool):
            raise TypeError(f"powersgd: {name} must be a bool, got {type(v).__name__}")
    if rank < 1:
        raise ValueError(f"powersgd: rank must be >= 1, got {rank}")
    if start_iter < 0:
        raise ValueError(f"powersgd: start_iter must be >= 0, got {start_iter}")
    if (error_feedback or warm_start) and start_iter <= 1:
        raise ValueError(
            f"powersgd: start_iter must be > 1 with error_feedback or warm_start (got "
            f"{start_iter}): DDP rebuilds its buckets after the first step"
        )
    for name, v in (("min_compression_rate", min_compression_rate), ("eps", eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"powersgd: {name} must be a number, got {type(v).__name__}")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"powersgd: {name} must be finite and >= 0, got {v}")
    state = PowerSGDState(
        rank,
        start_iter,
        float(min_compression_rate),
        bool(error_feedback),
        bool(warm_start),
        seed,
        float(eps),
    )
    return _PowerSGD(state)
