"""DGC's per-bucket memory and step (the hook, its state and collectives are comm/dgc.py).

A bucket's momentum and residual are two flat fp32 buffers in the bucket's layout, plus one
dump slot at the end where padded indices land, so clipping, momentum correction, selection and
masking are a fixed number of torch calls per bucket whatever its number of tensors. The
layout's tables (the segment plan of ``aiak::dgc_segments_select``, the dense positions, the
segment ids) are built once per layout and settings and kept on the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .dgc import DGCState

_OPS: list[Any] = []  # aiak.ops's (plan, select), imported on first use (lean import)


def _segments() -> tuple[Callable[..., torch.Tensor], Callable[..., Any]]:
    if not _OPS:
        # comm may use aiak.ops (the foundation); importing it registers the op
        from aiak.ops.dgc_segments import dgc_segments_plan, dgc_segments_select

        _OPS.extend((dgc_segments_plan, dgc_segments_select))
    return _OPS[0], _OPS[1]


def signature(buf: torch.Tensor, params: list) -> tuple:
    """What decides a bucket's layout, read without a torch call per tensor."""
    return (buf.numel(), buf.dtype, buf.device, tuple(map(id, params)))


class _Plan:
    """One bucket layout's tables for one ratio (built once, kept on the device)."""

    __slots__ = ("dpos", "kind", "n_rep", "segments", "start_rep", "strides", "table", "zeros")

    def __init__(self, mem: BucketMemory, ratio: float, state: DGCState) -> None:
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


class BucketMemory:
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
