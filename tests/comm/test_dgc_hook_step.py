"""The DGC hook's per-bucket step (comm/_dgc_bucket.py) in one process: the same results as a
per-tensor loop of the algorithm (momentum correction, clipping, selection by the float64
reference, masking), the per-parameter checkpoint format, and a number of torch ops per bucket
that does not grow with its tensors."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiak import comm
from aiak.comm import _dgc_bucket
from aiak.ops.dgc_bucket import BucketPlan

sys.path.insert(0, str(Path(__file__).parent))
from _dgc_ref import plan_f64, sparsify_f64


class Bucket:
    """A DDP-like bucket: gradients are views of one flat buffer, in order."""

    def __init__(self, shapes: list[tuple[int, ...]], index: int = 0) -> None:
        sizes = [int(np.prod(s)) for s in shapes]
        self.buf = torch.zeros(sum(sizes))
        self.params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        self.grads, at = [], 0
        for s, n in zip(shapes, sizes):
            self.grads.append(self.buf[at : at + n].view(s))
            at += n
        self.i = index

    def buffer(self) -> torch.Tensor:
        return self.buf

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def index(self) -> int:
        return self.i


SHAPES = [(40, 16), (40,), (30, 20), (7,), (3, 3, 5, 5)]


def _memory(state, bucket: Bucket) -> _dgc_bucket.BucketMemory:
    names = {p: f"p{i}" for i, p in enumerate(bucket.params)}
    sig = _dgc_bucket.signature(bucket.buf, bucket.params)
    return _dgc_bucket.BucketMemory(sig, bucket, names, state)


def _reference_step(state, grads, mmt, vec, gen):
    """One step of the algorithm per tensor (fp32 memory): dense values, selected (index,
    value) pairs in bucket positions."""
    ratio, m = state.ratio(), state.momentum
    uniforms = None
    dense, idx_all, val_all, at, seg = [], [], [], 0, 0
    big = [g.dim() > 1 for g in grads]
    nsamp = [plan_f64(g.numel(), ratio, state.sample_ratio)[1] for g, b in zip(grads, big) if b]
    strided = state.strided_sample
    uniforms = torch.rand(sum(big) if strided else sum(nsamp), generator=gen, dtype=torch.float64)
    first = 0
    for i, g in enumerate(grads):
        g = g.reshape(-1).clone()
        n = g.numel()
        if state.clip_grad_func == "norm":
            norm = torch.linalg.vector_norm(g, 2.0)
            g.mul_(torch.clamp(state.clip_grad_func_params["max_norm"] / (norm + 1e-6), max=1.0))
        body = mmt[i]
        if state.nesterov:
            body.add_(g).mul_(m)
        else:
            body.mul_(m).add_(g)
        if not big[i]:
            dense.append(body + g if state.nesterov else body.clone())
        else:
            vec[i].add_(body)
            if state.nesterov:
                vec[i].add_(g)
            _, ms, _, stride = plan_f64(n, ratio, state.sample_ratio)
            if ms == n:
                where = np.arange(n)
            elif strided:
                where = np.arange(ms) * stride + int(float(uniforms[seg]) * stride)
            else:
                where = (uniforms[first : first + ms].numpy() * n).astype(np.int64)
            first += ms
            seg += 1
            sel = sparsify_f64(vec[i].numpy(), ratio, state.sample_ratio, where, 1.3, 0.8, 10, True)
            sel = torch.from_numpy(sel[sel >= 0])
            val_all.append(vec[i][sel].clone())
            idx_all.append(sel + at)
            vec[i][sel] = 0
            if state.momentum_masking:
                mmt[i][sel] = 0
        at += n
    return torch.cat(dense), torch.cat(idx_all), torch.cat(val_all)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"nesterov": True},
        {"strided_sample": False, "momentum_masking": False},
        {"clip_grad_func": "norm", "clip_grad_func_params": {"max_norm": 0.5}},
        {"compress_ratio": 0.3, "sample_ratio": 1.0},
    ],
)
@pytest.mark.parametrize("path", ["select_reference", "select_multi"])
def test_bucket_step_equals_the_per_tensor_algorithm(kw, path, monkeypatch) -> None:
    # the CPU runs the reference loop; the multi-tensor path (CUDA's) is forced here too
    monkeypatch.setattr(BucketPlan, "select", getattr(BucketPlan, path))
    state = comm.dgc(**{"compress_ratio": 0.05, "momentum": 0.9, **kw}).state
    bucket = Bucket(SHAPES)
    mem = _memory(state, bucket)
    mmt = [torch.zeros(g.numel()) for g in bucket.grads]
    vec = [torch.zeros(g.numel()) for g in bucket.grads]
    data = torch.Generator().manual_seed(0)
    for step in range(4):
        bucket.buf.copy_(torch.randn(bucket.buf.numel(), generator=data))
        grads = [g.clone() for g in bucket.grads]
        dense, _, idx, vals = mem.step(state, bucket.buf, state.ratio(), _gen(step))
        e_dense, e_idx, e_vals = _reference_step(state, grads, mmt, vec, _gen(step))
        torch.testing.assert_close(dense, e_dense, rtol=1e-6, atol=1e-7)
        keep = idx < bucket.buf.numel()
        assert torch.equal(idx[keep], e_idx), step
        assert bool((vals[~keep] == 0).all())
        torch.testing.assert_close(vals[keep], e_vals, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mem.mmt[:-1], torch.cat(mmt), rtol=1e-6, atol=1e-7)
        big = [g.dim() > 1 for g in bucket.grads]
        got_vec = [mem.vec[o : o + n] for o, n, _ in mem.tensors]
        for b, got, ref in zip(big, got_vec, vec):
            torch.testing.assert_close(got, ref if b else torch.zeros_like(ref))


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def test_memory_keeps_the_per_parameter_checkpoint_format() -> None:
    hook = comm.dgc(compress_ratio=0.05)
    state = hook.state
    bucket = Bucket(SHAPES)
    state._mem = {0: _memory(state, bucket)}
    for step in range(3):
        bucket.buf.copy_(torch.randn(bucket.buf.numel()))
        state._mem[0].step(state, bucket.buf, state.ratio(), _gen(step))
    mmt, vec = state._mem[0].mmt.clone(), state._mem[0].vec.clone()
    loaded = pickle.loads(pickle.dumps(state))
    sizes = {f"p{i}": (g.numel(), g.dim() > 1) for i, g in enumerate(bucket.grads)}
    assert sorted(loaded.mmt) == sorted(sizes)
    assert sorted(loaded.vec) == sorted(k for k, (_, big) in sizes.items() if big)
    for key, (n, big) in sizes.items():
        assert loaded.mmt[key].numel() == (n + 1 if big else n)  # a dump slot when compressed
    # a new layout (or a loaded state) reads the memory back bit for bit
    again = _memory(loaded, bucket)
    assert torch.equal(again.mmt[:-1], mmt[:-1])
    assert torch.equal(again.vec[:-1], vec[:-1])


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_torch_ops_per_bucket_do_not_grow_with_its_tensors(clip, monkeypatch) -> None:
    monkeypatch.setattr(BucketPlan, "select", BucketPlan.select_multi)  # CUDA's path
    params = {"norm": {"max_norm": 1.0}, "value": {"clip_value": 0.1}}.get(clip)
    state = comm.dgc(compress_ratio=0.01, clip_grad_func=clip, clip_grad_func_params=params).state
    counts = []
    for repeat in (2, 30):
        bucket = Bucket([(64, 9), (64,)] * repeat)
        mem = _memory(state, bucket)
        bucket.buf.copy_(torch.randn(bucket.buf.numel()))
        mem.step(state, bucket.buf, state.ratio(), _gen(0))  # builds the plan
        with _Ops() as ops:
            mem.step(state, bucket.buf, state.ratio(), _gen(1))
        counts.append(ops.n)
    assert counts[0] == counts[1], counts


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"nesterov": True, "resample": False}, {"fp16_values": True}])
def test_bucket_step_on_cuda_equals_the_cpu_step(kw) -> None:
    state = comm.dgc(**{"compress_ratio": 0.01, **kw}).state
    cpu, gpu = Bucket(SHAPES), Bucket(SHAPES)
    gpu.buf = gpu.buf.cuda()
    gpu.grads = [gpu.buf[o : o + g.numel()].view(g.shape) for o, g in _offsets(cpu.grads)]
    mems = _memory(state, cpu), _memory(state, gpu)
    data = torch.Generator().manual_seed(3)
    for step in range(3):
        g = torch.randn(cpu.buf.numel(), generator=data)
        cpu.buf.copy_(g)
        gpu.buf.copy_(g)
        a = mems[0].step(state, cpu.buf, state.ratio(), _gen(step))
        b = mems[1].step(state, gpu.buf, state.ratio(), _gen(step))
        torch.testing.assert_close(b[0].cpu(), a[0], rtol=1e-6, atol=1e-7)
        assert torch.equal(b[2].cpu(), a[2]), step  # the same selection
        torch.testing.assert_close(b[3].cpu(), a[3], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mems[1].vec.cpu(), mems[0].vec, rtol=1e-6, atol=1e-7)
    # the device ran its selection as CUDA graph replays (no fallback to the calls one by one)
    assert state.cuda_graphs
    assert all(len(plan._graphs) == 1 for plan, _, _ in mems[1].plans.values())


def _offsets(grads: list[torch.Tensor]):
    at = 0
    for g in grads:
        yield at, g
        at += g.numel()
