"""DGC's per-bucket memory and compression step (the hook, its state and collectives are
comm/dgc.py).

Memory lives in two flat fp32 buffers per bucket (momentum, residual), laid out as the bucket
(one extra dump slot at the end for padded indices), so clipping, momentum correction,
selection and masking are a fixed number of torch launches per bucket, whatever the number of
tensors. A checkpoint keeps the per-parameter format: ``state.mmt[key]`` / ``state.vec[key]``
(``n + 1`` elements for a compressed tensor, its last one the dump slot, ``n`` for a dense
one); :func:`export` writes the flat buffers back into those dicts, and a new bucket layout
(DDP rebuilds its buckets after the first step, a loaded checkpoint) imports from them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

_PLAN: list[Any] = []  # aiak.ops's BucketPlan, imported on first use (lean import)


def _plan_class() -> Any:
    if not _PLAN:
        try:  # comm may use aiak.ops when it is installed (the bucket selection)
            from aiak.ops.dgc_bucket import BucketPlan
        except ImportError:  # pragma: no cover - aiak.ops ships with aiak
            BucketPlan = None
        _PLAN.append(BucketPlan)
    return _PLAN[0]


def signature(buf: torch.Tensor, params: list) -> tuple:
    """What decides a bucket's layout, read in O(1) torch calls (no per-tensor op)."""
    return (buf.numel(), buf.dtype, buf.device, tuple(map(id, params)))


class BucketMemory:
    """Momentum and residual of one bucket, its tensors' places, and plans per ratio."""

    __slots__ = ("clip_len", "keys", "length", "mmt", "plans", "sig", "tensors", "vec")

    def __init__(self, sig: tuple, bucket: Any, names: dict, state: Any) -> None:
        buf = bucket.buffer()
        base, params = buf.storage_offset(), bucket.parameters()
        self.sig, self.length = sig, buf.numel()
        self.tensors: list[tuple[int, int, bool]] = []  # (offset, numel, dim > 1)
        self.keys: list[str] = []
        for i, g in enumerate(bucket.gradients()):
            n = g.numel()
            p = params[i] if i < len(params) else None
            key = names.get(p) if p is not None else None
            self.keys.append(key or f"{bucket.index()}.{i}.{n}")
            self.tensors.append((g.storage_offset() - base, n, g.dim() > 1))
        order = sorted(range(len(self.tensors)), key=lambda i: self.tensors[i][0])
        self.tensors = [self.tensors[i] for i in order]
        self.keys = [self.keys[i] for i in order]
        dev = buf.device
        self.mmt = torch.zeros(self.length + 1, dtype=torch.float32, device=dev)
        self.vec = torch.zeros(self.length + 1, dtype=torch.float32, device=dev)
        for key, (off, n, _) in zip(self.keys, self.tensors):
            for flat, saved in ((self.mmt, state.mmt), (self.vec, state.vec)):
                t = saved.get(key)
                if t is not None and t.numel() in (n, n + 1):
                    flat[off : off + n].copy_(t.reshape(-1)[:n])
        # lengths covering the buffer, tensors and gaps, for per-tensor norms
        lens, at = [], 0
        for off, n, _ in self.tensors:
            if off > at:
                lens.append(off - at)
            lens.append(n)
            at = off + n
        if at < self.length:
            lens.append(self.length - at)
        self.clip_len = torch.tensor(lens, dtype=torch.int64).to(dev)
        self.plans: dict[float, tuple] = {}

    def export(self, state: Any, sparse: bool) -> None:
        """Write this bucket's memory into ``state.mmt`` / ``state.vec`` (per-key format)."""
        for key, (off, n, big) in zip(self.keys, self.tensors):
            m = self.mmt[off : off + n]
            if big and sparse:
                state.mmt[key] = torch.cat([m, m.new_zeros(1)])
                state.vec[key] = torch.cat([self.vec[off : off + n], m.new_zeros(1)])
            else:
                state.mmt[key] = m.clone()

    def plan(self, ratio: float, state: Any) -> tuple:
        """``(BucketPlan or None, dense positions, compressed (offset, numel))`` for ``ratio``."""
        got = self.plans.get(ratio)
        if got is None:
            sparse = [(off, n) for off, n, big in self.tensors if big and ratio < 1.0]
            dense = [range(off, off + n) for off, n, big in self.tensors if not big or ratio >= 1]
            dev = self.mmt.device
            dpos = None  # every element dense: the whole buffer, no position table
            if sparse:
                dpos = torch.tensor([i for r in dense for i in r], dtype=torch.int64).to(dev)
            cls = _plan_class()
            plan = None
            if sparse and cls is not None:
                plan = cls(
                    sparse, self.length, ratio, state.sample_ratio, state.strided_sample, dev
                )
            got = self.plans[ratio] = (plan, dpos, sparse)
        return got

    def clip(self, state: Any, buf: torch.Tensor) -> None:
        """Local clipping of every tensor of the bucket (in place)."""
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
        a = buf.float().abs()
        if math.isinf(p):
            norm = torch.segment_reduce(a, "max", lengths=self.clip_len, unsafe=True)
        else:
            norm = torch.segment_reduce(a.pow_(p), "sum", lengths=self.clip_len, unsafe=True)
            norm = norm.pow_(1.0 / p)
        # a device-side factor: no host sync for the comparison
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(buf.dtype)
        buf.mul_(torch.repeat_interleave(factor, self.clip_len, output_size=self.length))

    def step(
        self, state: Any, buf: torch.Tensor, ratio: float, gen: torch.Generator
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Clip, momentum, select and mask: ``(dense values, their positions (None: the whole
        buffer), selected positions, selected values)``; positions index the bucket, padding
        is ``length`` (the dump slot, value 0)."""
        plan, dpos, sparse = self.plan(ratio, state)
        self.clip(state, buf)
        length, m = self.length, state.momentum
        body = self.mmt[:length]
        if state.nesterov:
            body.add_(buf).mul_(m)
        else:
            body.mul_(m).add_(buf)
        if not sparse:
            return (body + buf if state.nesterov else body.clone()), None, None, None
        dense = None
        if dpos.numel():
            dense = body[dpos]
            if state.nesterov:
                dense += buf[dpos]
        vec = self.vec[:length]
        vec.add_(body)
        if state.nesterov:
            vec.add_(buf)
        if dpos.numel():
            vec.index_fill_(0, dpos, 0.0)  # dense tensors keep no residual
        if plan is None:  # aiak.ops absent: exact top-k per tensor, the same fixed-k contract
            idx = torch.cat([_topk(vec, off, n, ratio) for off, n in sparse])
        else:
            u = plan.sample_uniforms(gen)
            args = (
                vec, u, state.compress_upper_bound, state.compress_lower_bound,
                state.max_adaptation_iters, state.resample,
            )  # fmt: skip
            idx = None
            # on CUDA one graph replay per bucket (DGCState.cuda_graphs, default True)
            if vec.is_cuda and getattr(state, "cuda_graphs", True):
                try:
                    idx = plan.select_graphed(*args)
                except RuntimeError as exc:  # a capture this torch cannot do: say so, go on
                    state.cuda_graphs = False
                    warnings.warn(
                        f"dgc: capturing the bucket selection as a CUDA graph failed ({exc}); "
                        "it runs its torch calls one by one from now on (same results)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            if idx is None:
                idx = plan.select(*args)
        idx = torch.where(idx < 0, length, idx)
        vals = self.vec[idx]
        self.vec.index_fill_(0, idx, 0.0)  # the dump slot stays 0: padded values send 0
        if state.momentum_masking:
            self.mmt.index_fill_(0, idx, 0.0)
        return dense, dpos, idx, vals


def _topk(vec: torch.Tensor, off: int, n: int, ratio: float) -> torch.Tensor:
    k = min(n, max(1, math.ceil(n * ratio)))
    return torch.topk(vec[off : off + n].abs(), k, sorted=False).indices.sort().values + off
