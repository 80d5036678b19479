"""The DGC hook per bucket in one process: the same results as a per-tensor loop of the
algorithm (clipping, momentum correction, DGC's reference sampling and selection in float64,
masking), the per-parameter checkpoint format (an old-format state loads), and a number of torch
ops per bucket that does not grow with its tensors."""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from aiak import comm
from aiak.comm import _collectives, _futures
from aiak.comm._collectives import Link
from aiak.comm._dgc_bucket import BucketMemory, signature
from aiak.comm.dgc import DGCState

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
        self.step = 0

    def buffer(self) -> torch.Tensor:
        return self.buf

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def index(self) -> int:
        return self.i


# mixed sizes: sampled with a stride (2000 > 2/0.05), sampled whole, dense
SHAPES = [(50, 40), (40,), (30, 20), (7,), (3, 3, 5, 5), (4, 4), (2200, 1)]


def _names(bucket: Bucket) -> dict:
    return {p: f"p{i}" for i, p in enumerate(bucket.params)}


def _memory(state: DGCState, bucket: Bucket) -> BucketMemory:
    sig = signature(bucket.buf, bucket.params)
    return BucketMemory(sig, bucket, _names(bucket), state)


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _clip_ref(state: DGCState, g: torch.Tensor) -> None:
    fn, params = state.clip_grad_func, state.clip_grad_func_params
    if fn == "value":
        g.clamp_(-params["clip_value"], params["clip_value"])
    elif fn == "norm":
        norm = torch.linalg.vector_norm(g, float(params.get("norm_type", 2.0)))
        g.mul_(torch.clamp(params["max_norm"] / (norm + 1e-6), max=1.0))
    elif fn is not None:
        fn(g, **params)


def _reference_step(state, grads, mmt, vec, gen):
    """One step of the algorithm per tensor (fp32 memory), the random draws made as the hook
    makes them: dense values, selected (bucket position, value) pairs."""
    ratio, m, sr = state.ratio(), state.momentum, state.sample_ratio
    big = [g.dim() > 1 and ratio < 1 for g in grads]
    plans = [plan_f64(g.numel(), ratio, sr) for g, b in zip(grads, big) if b]
    if state.strided_sample:
        u = torch.rand(len(plans), generator=gen, dtype=torch.float64)
    else:
        u = torch.rand(sum(p[1] for p in plans), generator=gen, dtype=torch.float64)
    dense, idx_all, val_all, at, seg, first = [], [], [], 0, 0, 0
    for i, g in enumerate(grads):
        g = g.reshape(-1).clone()
        n = g.numel()
        _clip_ref(state, g)
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
            _, ms, _, stride = plans[seg]
            if ms == n:
                where = np.arange(n)
            elif state.strided_sample:
                where = np.arange(int(float(u[seg]) * stride), n, stride)
            else:
                where = (u[first : first + ms] * n).long().numpy()
            first += ms
            seg += 1
            sel = sparsify_f64(vec[i].numpy(), ratio, sr, where, 1.3, 0.8, 10, state.resample)
            sel = torch.from_numpy(sel[sel >= 0])
            val_all.append(vec[i][sel].clone())
            idx_all.append(sel + at)
            vec[i][sel] = 0
            if state.momentum_masking:
                mmt[i][sel] = 0
        at += n
    cat = lambda ts, like: torch.cat(ts) if ts else like  # noqa: E731
    return (
        cat(dense, None),
        cat(idx_all, torch.zeros(0, dtype=torch.int64)),
        cat(val_all, torch.zeros(0)),
    )


def _halve(g: torch.Tensor, scale: float) -> None:
    g.mul_(scale)


CASES = [
    {},
    {"nesterov": True},
    {"strided_sample": False, "momentum_masking": False},
    {"resample": False, "compress_ratio": 0.02},
    {"clip_grad_func": "norm", "clip_grad_func_params": {"max_norm": 0.5}},
    {"clip_grad_func": "norm", "clip_grad_func_params": {"max_norm": 0.5, "norm_type": "inf"}},
    {"clip_grad_func": "norm", "clip_grad_func_params": {"max_norm": 3.0, "norm_type": 1.5}},
    {"clip_grad_func": "value", "clip_grad_func_params": {"clip_value": 0.7}},
    {"clip_grad_func": _halve, "clip_grad_func_params": {"scale": 0.5}},
    {"compress_ratio": 0.3, "sample_ratio": 1.0},
    {"compress_ratio": 1.0},
]


def _compare_steps(state: DGCState, epochs: list[int]) -> None:
    bucket = Bucket(SHAPES)
    mem = _memory(state, bucket)
    mmt = [torch.zeros(g.numel()) for g in bucket.grads]
    vec = [torch.zeros(g.numel()) for g in bucket.grads]
    data = torch.Generator().manual_seed(0)
    for step, epoch in enumerate(epochs):
        state.set_epoch(epoch)
        bucket.buf.copy_(torch.randn(bucket.buf.numel(), generator=data))
        grads = [g.clone() for g in bucket.grads]
        _, dense, idx, vals = mem.step(state, bucket.buf, state.ratio(), _gen(step))
        e_dense, e_idx, e_vals = _reference_step(state, grads, mmt, vec, _gen(step))
        if e_dense is not None:
            torch.testing.assert_close(dense, e_dense, rtol=1e-5, atol=1e-6)
        if idx is None:
            assert e_idx.numel() == 0
        else:
            keep = idx < bucket.buf.numel()
            assert torch.equal(idx[keep], e_idx), step
            assert bool((vals[~keep] == 0).all())  # padding sends zeros
            torch.testing.assert_close(vals[keep], e_vals, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mem.mmt[:-1], torch.cat(mmt), rtol=1e-5, atol=1e-6)
        big = [g.dim() > 1 and state.ratio() < 1 for g in bucket.grads]
        for b, (o, n, matrix), ref in zip(big, mem.tensors, vec):
            if b:
                torch.testing.assert_close(mem.vec[o : o + n], ref, rtol=1e-5, atol=1e-6)
            elif not matrix:  # dense tensors keep no residual
                assert bool((mem.vec[o : o + n] == 0).all())
        assert mem.vec[-1] == 0 and mem.mmt[-1] == 0  # the dump slot


@pytest.mark.parametrize("kw", CASES)
def test_bucket_step_equals_the_per_tensor_algorithm(kw) -> None:
    state = comm.dgc(**{"compress_ratio": 0.05, "momentum": 0.9, **kw}).state
    _compare_steps(state, [0, 0, 0, 0])


def test_warm_up_from_dense_to_sparse_keeps_the_momentum() -> None:
    """Warm-up epochs at ratio 1 send everything densely; the momentum carries over into the
    first compressed epoch, and the warm-up ratios in between get their own plans."""
    state = comm.dgc(compress_ratio=0.02, warmup_epochs=2, warmup_coeff=[1.0, 0.2]).state
    _compare_steps(state, [0, 0, 1, 1, 2, 2])


@pytest.fixture(scope="module")
def world1(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("dgc_world1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield Link(dist.group.WORLD, (0,), inter=False)
    finally:
        dist.destroy_process_group()


def _reduce(hook, bucket: Bucket, link: Link) -> torch.Tensor:
    return _futures.real(hook.reduce(hook.state, bucket, link)).wait()


@pytest.mark.parametrize("fp16_values", [False, True])
def test_reduce_sends_the_selection_and_the_dense_tensors(world1, fp16_values) -> None:
    hook = comm.dgc(compress_ratio=0.05, fp16_values=fp16_values)
    state = hook.state
    bucket = Bucket(SHAPES, index=3)
    state._names = _names(bucket)
    mmt = [torch.zeros(g.numel()) for g in bucket.grads]
    vec = [torch.zeros(g.numel()) for g in bucket.grads]
    data = torch.Generator().manual_seed(1)
    for step in range(3):
        bucket.step = step
        bucket.buf.copy_(torch.randn(bucket.buf.numel(), generator=data) * 1e-3)
        grads = [g.clone() for g in bucket.grads]
        gen = torch.Generator().manual_seed(step * 7919 + 3)  # the hook's per-bucket seed
        e_dense, e_idx, e_vals = _reference_step(state, grads, mmt, vec, gen)
        out = _reduce(hook, bucket, world1)
        assert out.data_ptr() == bucket.buf.data_ptr()
        want = torch.zeros_like(bucket.buf)
        vdtype = torch.float16 if fp16_values else torch.float32
        want[e_idx] = e_vals.to(vdtype).float()
        dense_at = torch.cat(
            [torch.arange(o, o + n) for o, n, b in _memory(state, bucket).tensors if not b]
        )
        # fp16_values: the dense allreduce in fp16 as well (DGC's reference does so)
        want[dense_at] = e_dense.to(vdtype).float()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert fp16_values == bool((want[dense_at] != e_dense).any())  # fp16 rounds something


@pytest.mark.parametrize(
    ("shapes", "merged"),
    [(SHAPES, True), ([(20, 10), (5000,)], False)],  # 47 dense vs 253 pairs; 5000 vs 10
)
def test_small_dense_tensors_ride_in_the_allgather(world1, monkeypatch, shapes, merged) -> None:
    calls: list[int] = []
    real = _collectives.all_reduce_mean

    def spy(t, *args, **kwargs):
        calls.append(t.numel())
        return real(t, *args, **kwargs)

    monkeypatch.setattr(_collectives, "all_reduce_mean", spy)
    hook = comm.dgc(compress_ratio=0.05, momentum=0.0)
    bucket = Bucket(shapes)
    hook.state._names = _names(bucket)
    g = torch.randn(bucket.buf.numel(), generator=torch.Generator().manual_seed(2))
    bucket.buf.copy_(g)
    out = _reduce(hook, bucket, world1)
    dense_at = torch.cat(
        [torch.arange(o, o + n) for o, n, b in _memory(hook.state, bucket).tensors if not b]
    )
    assert calls == ([] if merged else [dense_at.numel()])
    torch.testing.assert_close(out[dense_at], g[dense_at], rtol=0, atol=0)  # world 1: the mean


def test_an_old_format_state_loads_and_round_trips(world1) -> None:
    """The per-tensor hook's checkpoint (per parameter: n + 1 fp32 for a compressed tensor, its
    last the dump slot; n for a dense one) is the format that pickles now as well."""
    bucket = Bucket(SHAPES)
    gen = torch.Generator().manual_seed(5)
    old_mmt, old_vec = {}, {}
    for i, g in enumerate(bucket.grads):
        n = g.numel()
        if g.dim() > 1:
            old_mmt[f"p{i}"] = torch.cat([torch.randn(n, generator=gen), torch.zeros(1)])
            old_vec[f"p{i}"] = torch.cat([torch.randn(n, generator=gen), torch.zeros(1)])
        else:
            old_mmt[f"p{i}"] = torch.randn(n, generator=gen)
    # the public fields the per-tensor hook's state pickled, with its memory
    fresh = comm.dgc(compress_ratio=0.05).state
    fields = {
        n: getattr(fresh, n)
        for cls in DGCState.__mro__
        for n in getattr(cls, "__slots__", ())
        if not n.startswith("_") and n != "process_group"
    }
    fields.update(mmt=old_mmt, vec=old_vec, step=7, seed=0)
    blob = pickle.dumps(fields)
    state = DGCState.__new__(DGCState)
    state.__setstate__(pickle.loads(blob))
    hook = comm.dgc(compress_ratio=0.05)
    hook.state = state
    state._names = _names(bucket)

    mmt = [old_mmt[f"p{i}"][: g.numel()].clone() for i, g in enumerate(bucket.grads)]
    vec = [
        old_vec[f"p{i}"][: g.numel()].clone() if f"p{i}" in old_vec else torch.zeros(g.numel())
        for i, g in enumerate(bucket.grads)
    ]
    bucket.buf.copy_(torch.randn(bucket.buf.numel(), generator=gen))
    grads = [g.clone() for g in bucket.grads]
    _reduce(hook, bucket, world1)
    _reference_step(state, grads, mmt, vec, torch.Generator().manual_seed(0))
    (mem,) = state._mem.values()
    torch.testing.assert_close(mem.mmt[:-1], torch.cat(mmt), rtol=1e-5, atol=1e-6)
    assert not state.mmt and not state.vec  # the memory lives in the bucket now, once

    # round trip: the same per-parameter format, the same values, and the run continues alike
    loaded = pickle.loads(pickle.dumps(state))
    assert sorted(loaded.mmt) == sorted(old_mmt) and sorted(loaded.vec) == sorted(old_vec)
    for key, t in old_mmt.items():
        assert loaded.mmt[key].shape == t.shape
        assert loaded.mmt[key][-1] == 0 or key not in old_vec
    for (o, n, b), key in zip(mem.tensors, mem.keys):
        assert torch.equal(loaded.mmt[key][:n], mem.mmt[o : o + n])
        if b:
            assert torch.equal(loaded.vec[key][:n], mem.vec[o : o + n])
    again = comm.dgc(compress_ratio=0.05)
    again.state = loaded
    loaded._names = _names(bucket)
    bucket.step = 1
    other = bucket.buf.clone()
    a = _reduce(hook, bucket, world1).clone()
    bucket.buf.copy_(other)
    b = _reduce(again, bucket, world1)
    assert torch.equal(a, b)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def _inline_all_gather(out, shard, link, traffic):
    """World 1's allgather done inline: gloo completes on its own thread, where a dispatch
    mode (thread-local) would miss the decode's ops some of the time."""
    out.copy_(shard)
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize("strided", [True, False])
def test_torch_ops_per_bucket_do_not_grow_with_its_tensors(
    world1, clip, strided, monkeypatch
) -> None:
    monkeypatch.setattr(_collectives, "all_gather", _inline_all_gather)
    params = {"norm": {"max_norm": 1.0}, "value": {"clip_value": 0.1}}.get(clip)
    counts = []
    for repeat in (4, 32):  # 8 and 64 tensors
        hook = comm.dgc(
            compress_ratio=0.01,
            strided_sample=strided,
            clip_grad_func=clip,
            clip_grad_func_params=params,
        )
        bucket = Bucket([(64, 90), (64,)] * repeat)
        bucket.buf.copy_(torch.randn(bucket.buf.numel()))
        _reduce(hook, bucket, world1)  # builds the layout and its tables
        bucket.step = 1
        with _Ops() as ops:
            _reduce(hook, bucket, world1)
        counts.append(ops.n)
        # the selection, the masking and the decode were all counted
        assert {"aiak.dgc_segments_select.default", "aten.index_add_.default"} <= ops.seen
    assert counts[0] == counts[1], counts
    assert counts[0] < 60, counts  # a few dozen per bucket


def test_a_new_layout_keeps_the_memory(world1) -> None:
    """DDP rebuilds its buckets after the first step: the memory follows the parameters."""
    hook = comm.dgc(compress_ratio=0.05)
    first = Bucket(SHAPES)
    hook.state._names = _names(first)
    first.buf.copy_(torch.randn(first.buf.numel()))
    _reduce(hook, first, world1)
    (mem,) = hook.state._mem.values()
    before = {k: mem.mmt[o : o + n].clone() for k, (o, n, _) in zip(mem.keys, mem.tensors)}
    # the same parameters in reverse order, in one bucket
    second = Bucket(SHAPES[::-1])
    second.params = first.params[::-1]
    hook.state._names = _names(first)
    second.buf.zero_()
    second.step = 1
    _reduce(hook, second, world1)
    (mem2,) = hook.state._mem.values()
    assert mem2 is not mem
    for k, (o, n, _) in zip(mem2.keys, mem2.tensors):
        # a zero gradient: momentum * 0.9, except where the mask cleared it
        got = mem2.mmt[o : o + n]
        ok = torch.isclose(got, before[k] * 0.9) | (got == 0)
        assert bool(ok.all()), k
        assert bool((got != 0).any()), k


def test_plan_follows_dgc_reference_rules() -> None:
    """Odd stride, at least 2/ratio samples, small tensors sampled whole, k_s from the samples
    (docs/dgc.md). The hook's tables are the op's plan; the float64 reference agrees."""
    from aiak.ops.dgc_segments import dgc_segments_plan

    ratio, sr = 0.001, 0.01
    sizes = [9408, 4096, 36864, 16384, 147456, 2359296, 1000, 2000, 2001, 2048000]
    plan = dgc_segments_plan(sizes, [0] * len(sizes), ratio, sr)
    for row, n in zip(plan.tolist(), sizes):
        k, m, ks, stride = plan_f64(n, ratio, sr)
        assert [row[2], row[4], row[5], row[6]] == [k, m, ks, stride]
        if n <= 2 / ratio:
            assert (m, stride) == (n, 1)
        else:
            assert stride % 2 == 1 and m >= 2 / ratio and m >= n * sr


def test_sample_ratio_is_floored_at_one_percent() -> None:
    with pytest.warns(UserWarning, match="raised to 0.01"):
        state = comm.dgc(sample_ratio=0.001).state
    assert state.sample_ratio == 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comm.dgc(sample_ratio=0.01).state.sample_ratio == 0.01


@pytest.mark.cuda
@pytest.mark.parametrize(
    "kw", [{}, {"nesterov": True, "resample": False}, {"strided_sample": False}]
)
def test_bucket_step_on_cuda_equals_the_cpu_step(kw) -> None:
    state = comm.dgc(**{"compress_ratio": 0.01, **kw}).state
    cpu, gpu = Bucket(SHAPES), Bucket(SHAPES)
    gpu.buf = gpu.buf.cuda()
    at, gpu.grads = 0, []
    for g in cpu.grads:
        gpu.grads.append(gpu.buf[at : at + g.numel()].view(g.shape))
        at += g.numel()
    mems = _memory(state, cpu), _memory(state, gpu)
    data = torch.Generator().manual_seed(3)
    for step in range(3):
        g = torch.randn(cpu.buf.numel(), generator=data)
        cpu.buf.copy_(g)
        gpu.buf.copy_(g)
        _, da, ia, va = mems[0].step(state, cpu.buf, state.ratio(), _gen(step))
        _, db, ib, vb = mems[1].step(state, gpu.buf, state.ratio(), _gen(step))
        torch.testing.assert_close(db.cpu(), da, rtol=1e-6, atol=1e-7)
        assert torch.equal(ib.cpu(), ia), step  # the same selection
        torch.testing.assert_close(vb.cpu(), va, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mems[1].vec.cpu(), mems[0].vec, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mems[1].mmt.cpu(), mems[0].mmt, rtol=1e-6, atol=1e-7)


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [None, "norm"])
def test_cuda_launches_per_bucket_do_not_grow_with_its_tensors(clip, monkeypatch) -> None:
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(_collectives, "all_gather", _inline_all_gather)
    link = Link(None, (0,), inter=False)  # world 1: no collective runs
    params = {"max_norm": 1.0} if clip else None
    counts = []
    for repeat in (4, 32):
        hook = comm.dgc(compress_ratio=0.01, clip_grad_func=clip, clip_grad_func_params=params)
        bucket = Bucket([(64, 90), (64,)] * repeat)
        bucket.buf = torch.randn(bucket.buf.numel(), device="cuda")
        at, bucket.grads = 0, []
        for p in bucket.params:
            bucket.grads.append(bucket.buf[at : at + p.numel()].view(p.shape))
            at += p.numel()
        _reduce(hook, bucket, link)
        bucket.step = 1
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _reduce(hook, bucket, link)
            torch.cuda.synchronize()
        counts.append(sum(e.count for e in prof.key_averages() if e.key in _LAUNCHES))
    assert counts[0] == counts[1] > 0, counts
