"""aiak::dgc_select: the op (reference on CPU, kernel on CUDA) against DGC's selection algorithm
written in float64 numpy (tests/comm/_dgc_ref.py); errors; opcheck; fixed-k output."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aiak.ops  # noqa: F401
from aiak.ops.dgc_select import dgc_select

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from _dgc_ref import select_f64
from _dgc_segments_ref import dgc_data as _data


def _check(x, k, m, start, stride, upper, lower, iters, resample, device="cpu", sidx=None):
    v, i = dgc_select(
        x.to(device), k, m, start, stride, None if sidx is None else sidx.to(device),
        upper, lower, iters, resample,
    )  # fmt: skip
    ev, ei = select_f64(
        x.numpy(), k, m, start, stride, upper, lower, iters, resample,
        None if sidx is None else sidx.numpy(),
    )  # fmt: skip
    assert v.shape == (k,) and i.shape == (k,) and i.dtype == torch.int64
    np.testing.assert_array_equal(i.cpu().numpy(), ei)
    np.testing.assert_array_equal(v.double().cpu().numpy(), ev)


@given(
    n=st.integers(1, 5000),
    ratio=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
    sample_ratio=st.sampled_from([0.01, 0.1, 1.0]),
    kind=st.sampled_from(["normal", "heavy", "ties", "ramp"]),
    resample=st.booleans(),
    iters=st.sampled_from([0, 1, 10, 20]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_the_float64_algorithm(
    n, ratio, sample_ratio, kind, resample, iters, seed
) -> None:
    x = _data(n, kind, seed)
    k = max(1, int(np.ceil(n * ratio)))
    m = max(1, int(np.ceil(n * sample_ratio)))
    stride = max(1, n // m)
    start = seed % stride
    _check(x, k, m, start, stride, 1.3, 0.8, iters, resample)


def test_random_sample_indices_and_padding() -> None:
    x = torch.zeros(1000)
    x[:3] = torch.tensor([5.0, -6.0, 7.0])
    sidx = torch.randint(0, 1000, (50,))
    _, i = dgc_select(x, 10, 50, 0, 1, sidx, 1.3, 0.8, 10, False)
    _check(x, 10, 50, 0, 1, 1.3, 0.8, 10, False, sidx=sidx)
    assert (i[: int((i >= 0).sum())] >= 0).all()
    _v, i = dgc_select(torch.randn(1000), 10, 100, 0, 10)
    assert i.shape == (10,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(k=11), "k must be"),
        (dict(num_samples=0), "num_samples"),
        (dict(sample_start=5, sample_stride=2), "leave the tensor"),
        (dict(upper=1.0), "upper"),
        (dict(lower=1.0), "lower"),
        (dict(iters=21), "iters"),
    ],
)
def test_bad_arguments_raise(kwargs, match) -> None:
    args = dict(k=3, num_samples=5, sample_start=0, sample_stride=2, upper=1.3, lower=0.8, iters=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dgc_select(torch.randn(10), **args)
    with pytest.raises(TypeError, match="dtype"):
        dgc_select(torch.arange(10), 3, 5)
    with pytest.raises(TypeError, match="k must be an int"):
        dgc_select(torch.randn(10), 3.0, 5)


def test_opcheck() -> None:
    x = torch.randn(4000)
    for resample in (True, False):
        torch.library.opcheck(
            torch.ops.aiak.dgc_select.default, (x, 40, 400, 3, 10, None, 1.3, 0.8, 10, resample)
        )


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "ramp"])
@pytest.mark.parametrize("resample", [True, False])
@pytest.mark.parametrize("n", [1, 777, 16384, 16385, 1_000_003])
def test_cuda_kernel_matches_the_algorithm(kind, resample, n) -> None:
    x = _data(n, kind, n)
    for ratio in (0.001, 0.05):
        k = max(1, int(np.ceil(n * ratio)))
        m = max(1, int(np.ceil(n * 0.01)))
        stride = max(1, n // m)
        _check(x, k, m, stride // 2, stride, 1.3, 0.8, 10, resample, device="cuda")
    sidx = torch.randint(0, n, (max(1, n // 100),))
    _check(x, max(1, n // 1000), sidx.numel(), 0, 1, 1.3, 0.8, 10, resample, "cuda", sidx)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("resample", "iters"),
    [(True, 20), (False, 10), (False, 20), (True, 0)],  # thresholds: 21, 66, 231 (search), 1
)
def test_cuda_kernel_threshold_tables(resample, iters) -> None:
    for kind in ("heavy", "ties", "normal"):
        x = _data(300_001, kind, iters)
        _check(x, 301, 3001, 50, 99, 1.3, 0.8, iters, resample, device="cuda")


@pytest.mark.cuda
def test_cuda_kernel_unaligned_zeros_and_reuse() -> None:
    # a view at offset 1 of a device buffer: no 16-byte loads; half zeros: thr0 can be 0
    base = _data(200_001, "heavy", 7)
    base[::2] = 0
    x, xd = base[1:], base.cuda()[1:]
    assert xd.data_ptr() % 16 != 0
    for ratio in (0.001, 0.01, 0.4):  # the same workspace again and again, then other k
        k = max(1, int(np.ceil(x.numel() * ratio)))
        ev, ei = select_f64(x.numpy(), k, 2000, 3, 100, 1.3, 0.8, 10, True)
        for _ in range(2):
            v, i = dgc_select(xd, k, 2000, 3, 100, None, 1.3, 0.8, 10, True)
            np.testing.assert_array_equal(i.cpu().numpy(), ei)
            np.testing.assert_array_equal(v.double().cpu().numpy(), ev)
    z = torch.zeros(50_000)
    _check(z, 50, 500, 0, 100, 1.3, 0.8, 10, True, device="cuda")
    _check(z, 50, 500, 0, 100, 1.3, 0.8, 10, False, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("iters", [3, 4, 10, 20])
@pytest.mark.parametrize("outlier", [6.45, 8.06, 1000.0])
def test_cuda_kernel_thr0_too_high_walks_down_past_the_fast_count(iters, outlier) -> None:
    """Every sample at one outlier puts thr0 at it: the loop lowers the threshold state by
    state (0.8 each), ending at the 4th state (6.45: the fast count's last), the 5th (8.06:
    the gated full count runs) or running out of iterations (1000)."""
    x = _data(400_003, "normal", 1)
    x[0] = outlier
    sidx = torch.zeros(4000, dtype=torch.int64)
    _check(x, 400, 4000, 0, 1, 1.3, 0.8, iters, True, device="cuda", sidx=sidx)
    _check(x, 400, 4000, 0, 1, 1.3, 0.8, iters, False, device="cuda", sidx=sidx)


@pytest.mark.cuda
@pytest.mark.parametrize("programmatic", [True, False])
def test_cuda_calls_back_to_back_between_torch_kernels(programmatic) -> None:
    """Each launch after the first may start before the one before it ends (sm_90+): torch
    kernels that rewrite x right before and right after every call must not leak into it."""
    from aiak.ops import _driver

    data = [_data(300_007, kind, 3) for kind in ("heavy", "ties", "normal")]
    want = [select_f64(d.numpy(), 300, 3000, 1, 100, 1.3, 0.8, 10, True) for d in data]
    dev = [d.cuda() for d in data]
    x = torch.empty_like(dev[0])
    previous = _driver.programmatic_launches(programmatic)
    try:
        got = []
        for r in range(12):
            x.copy_(dev[r % 3])
            v, i = dgc_select(x, 300, 3000, 1, 100, None, 1.3, 0.8, 10, True)
            x.neg_()  # a plain launch right after: it must wait for every kernel of the call
            got.append((v, i))
    finally:
        _driver.programmatic_launches(previous)
    for r, (v, i) in enumerate(got):
        ev, ei = want[r % 3]
        np.testing.assert_array_equal(i.cpu().numpy(), ei)
        np.testing.assert_array_equal(v.double().cpu().numpy(), ev)


@pytest.mark.cuda
def test_cuda_graphs_captured_on_one_stream_replay_on_two_at_once() -> None:
    """Two graphs captured on torch's shared capture stream, with the same sizes, get a
    workspace each (none from the per-stream cache), so they replay on two streams at once."""
    from aiak.ops import _dgc_select_cuda

    data = [_data(400_009, kind, 5) for kind in ("heavy", "normal")]
    want = [select_f64(d.numpy(), 400, 4000, 0, 100, 1.3, 0.8, 10, True) for d in data]
    xs = [d.cuda() for d in data]
    for x in xs:  # warm-up outside capture: compiles and caches the eager workspace
        dgc_select(x, 400, 4000, 0, 100, None, 1.3, 0.8, 10, True)
    torch.cuda.synchronize()
    cached = len(_dgc_select_cuda._workspaces)
    graphs, outs = [], []
    for x in xs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(dgc_select(x, 400, 4000, 0, 100, None, 1.3, 0.8, 10, True))
        graphs.append(g)
    assert len(_dgc_select_cuda._workspaces) == cached
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for g, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                g.replay()
    torch.cuda.synchronize()
    for (v, i), (ev, ei) in zip(outs, want):
        np.testing.assert_array_equal(i.cpu().numpy(), ei)
        np.testing.assert_array_equal(v.double().cpu().numpy(), ev)
