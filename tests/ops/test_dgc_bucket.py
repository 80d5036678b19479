"""aiak.ops.dgc_bucket: one bucket's DGC selection against the float64 numpy algorithm of DGC's
reference code (tests/comm/_dgc_ref.py), its sampling rules, the per-step rounding of the
threshold, and a launch count that does not grow with the number of tensors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from aiak.ops.dgc_bucket import BucketPlan, sample_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from _dgc_ref import plan_f64, sparsify_f64

CPU = torch.device("cpu")


def _data(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "heavy":  # a few large entries: the sample misses them, the loop adapts
        x = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
        x[rng.integers(0, n, max(1, n // 500))] *= np.float32(1e4)
        return x
    if kind == "ties":  # few distinct values: the exact top-k and its tie breaking
        return rng.integers(-3, 4, n).astype(np.float32)
    return np.linspace(-1, 1, n, dtype=np.float32)  # strides alias with the structure


def _expected(x, segs, ratio, sr, strided, u, upper, lower, iters, resample) -> np.ndarray:
    out, first = [], 0
    for j, (off, n) in enumerate(segs):
        _, m, _, stride = plan_f64(n, ratio, sr)
        if strided or m == n:
            start = int(float(u[j]) * stride) if strided and m < n else 0
            at = np.arange(m) * stride + start
        else:
            at = (u[first : first + m].numpy() * n).astype(np.int64)
        first += m
        e = sparsify_f64(x[off : off + n], ratio, sr, at, upper, lower, iters, resample)
        out.append(np.where(e >= 0, e + off, -1))
    return np.concatenate(out)


def _run(device, segs, length, x, ratio, sr, strided, seed, iters, resample):
    plan = BucketPlan(segs, length, ratio, sr, strided, device)
    u = plan.sample_uniforms(torch.Generator().manual_seed(seed))
    exp = _expected(x, segs, ratio, sr, strided, u.cpu(), 1.3, 0.8, iters, resample)
    xd = torch.from_numpy(x).to(device)
    for select in (plan.select_reference, plan.select_multi):
        got = select(xd, u, 1.3, 0.8, iters, resample)
        assert got.dtype == torch.int64 and got.shape == (plan.total,)
        np.testing.assert_array_equal(got.cpu().numpy(), exp, err_msg=select.__name__)


_CASE = {
    "sizes": st.lists(st.sampled_from([1, 7, 64, 300, 2000, 12000]), min_size=1, max_size=6),
    "gaps": st.lists(st.integers(0, 3), min_size=6, max_size=6),
    "ratio": st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]),
    "sr": st.sampled_from([0.001, 0.01, 0.05, 1.0]),
    "kind": st.sampled_from(["normal", "heavy", "ties", "ramp"]),
    "strided": st.booleans(),
    "resample": st.booleans(),
    "iters": st.sampled_from([0, 1, 3, 10]),
    "seed": st.integers(0, 2**16),
}


def _layout(sizes, gaps):
    segs, at = [], 0
    for n, g in zip(sizes, gaps):
        at += g
        segs.append((at, n))
        at += n
    return segs, at + gaps[-1]


@given(**_CASE)
def test_bucket_matches_the_float64_algorithm(
    sizes, gaps, ratio, sr, kind, strided, resample, iters, seed
) -> None:
    segs, length = _layout(sizes, gaps)
    x = _data(length, kind, np.random.default_rng(seed))
    _run(CPU, segs, length, x, ratio, sr, strided, seed, iters, resample)


@pytest.mark.cuda
@given(**_CASE)
def test_bucket_on_cuda_matches_the_float64_algorithm(
    sizes, gaps, ratio, sr, kind, strided, resample, iters, seed
) -> None:
    segs, length = _layout(sizes, gaps)
    x = _data(length, kind, np.random.default_rng(seed))
    _run(torch.device("cuda"), segs, length, x, ratio, sr, strided, seed, iters, resample)


@given(
    n=st.integers(1, 10**7),
    ratio=st.sampled_from([0.0001, 0.001, 0.01, 0.1, 0.5]),
    sr=st.sampled_from([0.0001, 0.005, 0.01, 0.1, 0.9, 1.0]),
)
def test_sampling_rules_of_the_reference(n, ratio, sr) -> None:
    k, m, ks, stride = sample_plan(n, ratio, sr)
    assert k == min(n, math.ceil(n * ratio))
    assert ks == math.ceil(m * ratio)  # k_s from the compress ratio and the sample count
    if sr >= 1.0 or n <= math.ceil(2 / ratio):  # sampled whole
        assert (m, stride) == (n, 1)
    else:
        assert stride % 2 == 1 and m == n // stride
        # at least 2/ratio samples, and the sample ratio floored at 0.01
        assert m >= max(math.ceil(n * max(sr, 0.01)), math.ceil(2 / ratio))


def test_sample_ratio_is_floored_at_one_percent() -> None:
    assert sample_plan(10**6, 0.001, 0.0001) == sample_plan(10**6, 0.001, 0.01)
    assert sample_plan(10**6, 0.001, 0.0001)[1] >= 10**4


def test_no_adaptation_when_the_tensor_is_sampled_whole() -> None:
    # k = 2 of 4 (n <= 2/ratio: sampled whole). Threshold: the 2nd largest, 1; four entries
    # reach it (> 1.3 k), which would take the exact top-2 {0, 3} after adaptation; without
    # adaptation the first two at or above it are kept.
    x = torch.tensor([1.0, 1.0, 1.0, 2.0])
    plan = BucketPlan([(0, 4)], 4, 0.5, 0.01, True, CPU)
    u = plan.sample_uniforms(torch.Generator())
    for select in (plan.select_reference, plan.select_multi):
        assert select(x, u, 1.3, 0.8, 10, True).tolist() == [0, 1]
    # a tensor sampled by stride adapts: 2001 entries reach thr0 = 1 (> 1.3 k), so the exact
    # top-1000 is taken: the 2 and the first 999 ones
    n = 100_000
    y = torch.zeros(n)
    y[:2000] = 1.0
    y[5000] = 2.0
    plan = BucketPlan([(0, n)], n, 0.01, 0.01, True, CPU)
    assert plan.nsamples[0] < n
    for select in (plan.select_reference, plan.select_multi):
        got = select(y, torch.zeros(1, dtype=torch.float64), 1.3, 0.8, 10, True)
        assert got.tolist() == [*range(999), 5000]


def _rounding_case() -> tuple[float, float, float]:
    """thr0 whose second lower step differs: (thr0, repeated rounding, single rounding)."""
    rng = np.random.default_rng(1)
    low = np.float32(0.8)
    for t in rng.uniform(1, 2, 10_000).astype(np.float32):
        rep = np.float32(np.float32(t * low) * low)
        single = np.float32(np.float64(t) * 0.8 * 0.8)
        if rep < single:
            return float(t), float(rep), float(single)
    raise AssertionError("no such threshold")


def test_threshold_is_rounded_at_every_adaptation_step() -> None:
    t0, rep, single = _rounding_case()
    assert rep < single  # rounded once, the second step's threshold would be higher
    n, ratio = 100_000, 0.01  # k = 1000; stride 97, 1030 samples, k_s = 11
    k, m, ks, stride = sample_plan(n, ratio, 0.01)
    assert (k, m, ks, stride) == (1000, 1030, 11, 97)
    x = np.zeros(n, dtype=np.float32)
    x[np.arange(ks) * stride] = t0  # the 11 largest samples: thr0 = t0, count 11 < 0.8 k
    free = np.setdiff1d(np.arange(n), np.arange(m) * stride)
    x[free[:900]] = rep  # reached at the 2nd step only when it is rounded per step
    below = np.float32(rep * np.float32(0.9))
    x[free[900:1400]] = below  # reached at the 3rd step
    plan = BucketPlan([(0, n)], n, ratio, 0.01, True, CPU)
    exp = sparsify_f64(x, ratio, 0.01, np.arange(m) * stride, 1.3, 0.8, 10, True)
    u = torch.zeros(1, dtype=torch.float64)
    for select in (plan.select_reference, plan.select_multi):
        got = select(torch.from_numpy(x), u, 1.3, 0.8, 10, True)
        np.testing.assert_array_equal(got.numpy(), exp)
        # per-step rounding stops at thr = rep with 911 entries; a single rounding (rep <
        # single) would go one step further, count 1411 > 1.3 k and take the exact top-1000
        assert int((got >= 0).sum()) == ks + 900


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("resample", [True, False])
def test_torch_ops_per_bucket_do_not_grow_with_its_tensors(resample: bool) -> None:
    # the multi-tensor path, CUDA's (on the CPU the loop over segments runs instead)
    counts = []
    for ntensors in (3, 60):
        segs = [(i * 5000, 5000) for i in range(ntensors)]
        length = ntensors * 5000
        plan = BucketPlan(segs, length, 0.01, 0.01, True, CPU)
        x = torch.randn(length)
        u = plan.sample_uniforms(torch.Generator())
        with _Ops() as ops:
            plan.select_multi(x, u, 1.3, 0.8, 10, resample)
        counts.append(ops.n)
    assert counts[0] == counts[1], counts


def test_segments_must_be_inside_the_buffer_and_disjoint() -> None:
    with pytest.raises(ValueError, match="overlaps or leaves"):
        BucketPlan([(0, 10), (5, 10)], 20, 0.1, 0.01, True, CPU)
    with pytest.raises(ValueError, match="overlaps or leaves"):
        BucketPlan([(15, 10)], 20, 0.1, 0.01, True, CPU)


@pytest.mark.cuda
@pytest.mark.parametrize("resample", [True, False])
def test_graph_replay_equals_the_eager_selection(resample: bool) -> None:
    dev = torch.device("cuda")
    segs = [(0, 50_000), (50_003, 7), (50_010, 200_000)]
    plan = BucketPlan(segs, 250_010, 0.001, 0.01, True, dev)
    x = torch.empty(250_010, device=dev)  # one address, new values every step
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x.copy_(
            torch.from_numpy(
                _data(x.numel(), ("normal", "heavy")[step % 2], np.random.default_rng(step))
            )
        )
        u = plan.sample_uniforms(gen)
        eager = plan.select(x, u, 1.3, 0.8, 10, resample)
        graphed = plan.select_graphed(x, u, 1.3, 0.8, 10, resample).clone()
        assert torch.equal(graphed, eager), step
    assert len(plan._graphs) == 1  # captured once
