"""aiak::dgc_segments_select: the plan and the op (reference on CPU, kernel on CUDA) against
DGC's per-segment selection written in numpy (tests/ops/_dgc_segments_ref.py); errors; opcheck."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _dgc_segments_ref import dgc_data, plan_rows, select
from hypothesis import given, settings
from hypothesis import strategies as st

import aiak.ops  # noqa: F401
from aiak.conformance.shapes import RESNET50
from aiak.ops.dgc_segments import dgc_segments_plan, dgc_segments_select, host_plan

RESNET50_NUMELS = [math.prod(shape) for shape in RESNET50]


def _layout(lengths: list[int], gaps: list[int]) -> tuple[list[int], int]:
    """Segment starts with a gap before each (dense tensors of the bucket), and x's size."""
    starts, pos = [], 0
    for n, gap in zip(lengths, gaps):
        pos += gap
        starts.append(pos)
        pos += n
    return starts, pos + 3


def _run(x, lengths, starts, ratio, sr, s0_seed, uniform, upper, lower, iters, resample, dev):
    table = dgc_segments_plan(lengths, starts, ratio, sr)
    rows = table.tolist()
    g = torch.Generator().manual_seed(s0_seed)
    s0 = torch.tensor([int(torch.randint(0, r[6], (1,), generator=g)) for r in rows])
    sidx = None
    if uniform:
        sidx = torch.cat([r[0] + torch.randint(0, r[1], (r[4],), generator=g) for r in rows]).long()
    v, i = dgc_segments_select(
        x.to(dev), table.to(dev), s0.to(dev), None if sidx is None else sidx.to(dev),
        upper, lower, iters, resample,
    )  # fmt: skip
    ev, ei = select(
        x.numpy(), rows, s0.tolist(), None if sidx is None else sidx.numpy(),
        upper, lower, iters, resample,
    )  # fmt: skip
    k_total = sum(r[2] for r in rows)
    assert v.shape == (k_total,) and i.shape == (k_total,) and i.dtype == torch.int64
    np.testing.assert_array_equal(i.cpu().numpy(), ei)
    np.testing.assert_array_equal(v.double().cpu().numpy(), ev)
    return v.cpu(), i.cpu()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6000), min_size=1, max_size=6),
    gap=st.integers(0, 5),
    ratio=st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]),
    sample_ratio=st.sampled_from([0.001, 0.01, 0.1, 1.0]),
    kind=st.sampled_from(["normal", "heavy", "ties", "ramp", "special"]),
    resample=st.booleans(),
    uniform=st.booleans(),
    iters=st.sampled_from([0, 1, 3, 10, 20]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_the_numpy_algorithm(
    lengths, gap, ratio, sample_ratio, kind, resample, uniform, iters, seed
) -> None:
    starts, size = _layout(lengths, [gap * (j % 3) for j in range(len(lengths))])
    x = dgc_data(size, kind, seed)
    _run(x, lengths, starts, ratio, sample_ratio, seed, uniform, 1.3, 0.8, iters, resample, "cpu")


def test_plan_rows_by_hand() -> None:
    p = dgc_segments_plan([2304, 2359296, 10], [5, 2309, 2361605], 0.001, 0.01).tolist()
    # 2304 > ceil(2/0.001) = 2000: strides 33, 25, 17, 9 sample too few; stride 1 samples whole
    assert p[0] == [5, 2304, 3, 0, 2304, 3, 1, 0]
    # pct = 23593; stride ceil(2359296 / 23593 / 32) * 32 + 1 = 129 -> 121 -> ... -> 97
    assert p[1] == [2309, 2359296, 2360, 3, 2359296 // 97, 25, 97, 2304]
    assert p[2] == [2361605, 10, 1, 2363, 10, 1, 1, 2304 + 24322]
    # sample_ratio floored at 0.01 and capped at 1; k at most n
    q = dgc_segments_plan([100_000, 7], [0, 100_000], 0.01, 0.0001).tolist()
    # pct = 1000 > cpr = 200; strides 129 (775 samples), 121, 113, 105, 97 (1030); ks 11
    assert q[0] == [0, 100_000, 1000, 0, 1030, 11, 97, 0]
    assert dgc_segments_plan([7], [0], 1.0, 5.0).tolist() == [[0, 7, 7, 0, 7, 7, 1, 0]]
    assert dgc_segments_plan([], [], 0.01, 0.01).shape == (0, 8)


@given(
    lengths=st.lists(st.integers(1, 10**7), min_size=1, max_size=8),
    ratio=st.sampled_from([0.0001, 0.001, 0.003, 0.01, 0.1, 1.0]),
    sample_ratio=st.sampled_from([0.0, 0.005, 0.01, 0.02, 0.5, 1.0, 2.0]),
)
def test_plan_matches_the_formula(lengths, ratio, sample_ratio) -> None:
    starts = list(np.cumsum([0, *lengths[:-1]]))
    got = dgc_segments_plan(lengths, [int(s) for s in starts], ratio, sample_ratio)
    assert got.tolist() == plan_rows(lengths, starts, ratio, sample_ratio)
    for _start, n, k, _, m, ks, stride, _ in got.tolist():
        assert 1 <= k <= n and 1 <= ks <= m <= n
        assert (m == n) == (stride == 1)
        assert stride % 2 == 1  # an odd stride
        assert m == n or m == n // stride


def test_ties_take_the_lowest_indices_and_whole_samples_do_not_adapt() -> None:
    x = torch.ones(10_000)
    x[-100:] = 2.0
    rows = dgc_segments_plan([10_000], [0], 0.01, 0.01)
    s0 = torch.zeros(1, dtype=torch.int64)
    assert rows[0, 4] < 10_000  # sampled: ks-th largest sample is 1, c = 10000 > 1.3 * 100
    _, i = dgc_segments_select(x, rows, s0, None, 1.3, 0.8, 10, True)  # resample stop: top-k
    assert i.tolist() == list(range(9900, 10_000))
    _, i = dgc_segments_select(x, rows, s0, None, 1.3, 0.8, 0, True)  # no loop: first k >= 1
    assert i.tolist() == list(range(100))
    whole = dgc_segments_plan([10_000], [0], 0.01, 1.0)
    _, i = dgc_segments_select(x, whole, s0, None, 1.3, 0.8, 10, True)  # thr 2: no resample
    assert i.tolist() == list(range(9900, 10_000))
    x[-100:] = 1.0  # all tied, sampled whole: thr = 1, the first k, no adaptation
    _, i = dgc_segments_select(x, whole, s0, None, 1.3, 0.8, 10, False)
    assert i.tolist() == list(range(100))


def test_without_resample_the_threshold_walks_up_and_down() -> None:
    x = torch.ones(10_000)  # k = 100; thr 1 -> 1.3 (c 0) -> 1.04 (0) -> 0.832 (all) -> 1.08 (0)
    seen = {}
    for iters in range(8):
        _v, i = _run(x, [10_000], [0], 0.01, 0.01, 0, False, 1.3, 0.8, iters, False, "cpu")
        seen[iters] = i.tolist()
    assert seen[0] == seen[3] == seen[5] == seen[7] == list(range(100))
    assert seen[1] == seen[2] == seen[4] == seen[6] == [-1] * 100  # above every entry: padding


def test_k_equals_n_padding_and_special_values() -> None:
    x = torch.tensor([0.0, float("nan"), -float("inf"), 1e-40, -2.0, 0.0, 3.0])
    v, i = _run(x, [7], [0], 1.0, 1.0, 0, False, 1.3, 0.8, 10, True, "cpu")
    assert i.tolist() == list(range(7))  # k == n: everything, in order
    x = torch.zeros(50_000)
    x[:3] = torch.tensor([5.0, -6.0, float("nan")])
    x[25_000:25_003] = torch.tensor([7.0, float("inf"), -1e-39])
    table = dgc_segments_plan([25_000, 25_000], [0, 25_000], 0.01, 0.01)
    sidx = torch.zeros(int(table[:, 4].sum()), dtype=torch.int64)  # every sample is x[0] = 5
    s0 = torch.zeros(2, dtype=torch.int64)
    v, i = dgc_segments_select(x, table, s0, sidx, 1.3, 0.8, 0, True)  # thr 5, no loop
    ev, ei = select(x.numpy(), table.tolist(), [0, 0], sidx.numpy(), 1.3, 0.8, 0, True)
    np.testing.assert_array_equal(i.numpy(), ei)
    np.testing.assert_array_equal(v.double().numpy(), ev)  # NaN equals NaN here
    assert i[:3].tolist() == [0, 1, 2] and i[250:252].tolist() == [25_000, 25_001]
    assert (i[3:250] == -1).all() and (v[3:250] == 0).all()  # padded to each segment's k
    assert (i[252:] == -1).all()
    for uniform in (False, True):
        _run(x, [25_000, 25_000], [0, 25_000], 0.001, 0.01, 1, uniform, 1.3, 0.8, 10, True, "cpu")


def test_resnet50_bucket_on_cpu() -> None:
    lengths = RESNET50_NUMELS
    starts, size = _layout(lengths, [0] * len(lengths))
    x = dgc_data(size, "heavy", 50)
    _run(x, lengths, starts, 0.001, 0.01, 5, False, 1.3, 0.8, 10, True, "cpu")


def _args(**kw):
    x = torch.randn(9000)
    table = dgc_segments_plan([4000, 4995], [0, 4005], 0.1, 0.01)  # strides 97, m 41 and 51
    a = dict(
        x=x, table=table, sample_start=torch.zeros(2, dtype=torch.int64), sample_indices=None,
        upper=1.3, lower=0.8, iters=10, resample=True,
    )  # fmt: skip
    a.update(kw)
    return a


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        (dict(x=torch.randn(9000).double()), TypeError, "x has dtype"),
        (dict(x=torch.randn(90, 100)), ValueError, "1-D"),
        (dict(x=torch.randn(18000)[::2]), ValueError, "contiguous"),
        (dict(x=torch.randn(8999)), ValueError, "not inside x"),
        (dict(table=torch.zeros(2, 8, dtype=torch.int32)), TypeError, "table"),
        (dict(table=torch.zeros(2, 7, dtype=torch.int64)), ValueError, "table"),
        (dict(sample_start=torch.zeros(2)), TypeError, "sample_start"),
        (dict(sample_start=torch.zeros(3, dtype=torch.int64)), ValueError, "sample_start"),
        (dict(sample_start=torch.tensor([0, 200])), ValueError, "sample_start"),
        (dict(sample_indices=torch.zeros(3, dtype=torch.int64)), ValueError, "sample_indices"),
        (dict(sample_indices=torch.zeros(92)), TypeError, "sample_indices"),
        (dict(sample_indices=torch.full((92,), 9000)), ValueError, "sample_indices"),
        (dict(upper=1.0), ValueError, "upper"),
        (dict(lower=1.0), ValueError, "lower"),
        (dict(iters=21), ValueError, "iters"),
        (dict(iters=2.0), TypeError, "iters"),
    ],
)
def test_bad_arguments_raise(kw, err, match) -> None:
    a = _args(**kw)
    with pytest.raises(err, match=match):
        dgc_segments_select(**a)


def test_bad_plans_raise() -> None:
    with pytest.raises(ValueError, match="lengths"):
        dgc_segments_plan([1, 2], [0], 0.1, 0.1)
    with pytest.raises(ValueError, match="ratio"):
        dgc_segments_plan([10], [0], 0.0, 0.1)
    with pytest.raises(ValueError, match="sample_ratio"):
        dgc_segments_plan([10], [0], 0.1, float("nan"))
    with pytest.raises(ValueError, match="n >= 1"):
        dgc_segments_plan([0], [0], 0.1, 0.1)
    with pytest.raises(TypeError, match="lengths"):
        dgc_segments_plan([1.5], [0], 0.1, 0.1)
    table = dgc_segments_plan([40, 50], [0, 45], 0.1, 0.01)
    table[1, 3] += 1  # out_off not cumulative
    with pytest.raises(ValueError, match="cumulative"):
        dgc_segments_select(torch.randn(100), table, torch.zeros(2, dtype=torch.int64))
    table = dgc_segments_plan([40, 30], [50, 0], 0.1, 0.01)  # not in order: the first ends last
    plan = host_plan(table, 100)
    assert plan.K == 7 and plan.end == 90
    with pytest.raises(ValueError, match="not inside x"):
        host_plan(table, 89)
    table = dgc_segments_plan([40], [-1 + 1], 0.1, 0.01)
    table[0, 0] = -1  # start out of range
    with pytest.raises(ValueError, match="not inside x"):
        dgc_segments_select(torch.randn(100), table, torch.zeros(1, dtype=torch.int64))


def test_opcheck_and_empty_plan() -> None:
    table = dgc_segments_plan([3000, 1000], [0, 3000], 0.01, 0.01)
    x = torch.randn(4000)
    for resample in (True, False):
        torch.library.opcheck(
            torch.ops.aiak.dgc_segments_select.default,
            (x, table, torch.tensor([3, 0]), None, 1.3, 0.8, 10, resample),
        )
    empty = dgc_segments_plan([], [], 0.01, 0.01)
    v, i = dgc_segments_select(x, empty, torch.zeros(0, dtype=torch.int64))
    assert v.shape == (0,) and i.shape == (0,)


@pytest.mark.parametrize(("iters", "resample"), [(10, True), (10, False), (0, True), (3, True)])
def test_launches_are_fixed_whatever_the_number_of_segments(
    recorder, monkeypatch, iters, resample
) -> None:
    """The launcher on the CPU with cuLaunchKernelEx recorded: the same launches for 1, 7 or
    161 segments, grids over the whole bucket (tiles, sample blocks, segments)."""
    from aiak.ops import _dgc_segments_cuda as cu
    from aiak.ops.dgc_segments import check, launches_per_call

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    tile, samp = cu._TILE, cu._SAMP
    for lengths in ([5000], [1, 4096, 4097, 9000, 2304, 70_000, 3], RESNET50_NUMELS):
        starts, size = _layout(lengths, [1] * len(lengths))
        x = torch.zeros(size)
        table = dgc_segments_plan(lengths, starts, 0.001, 0.01)
        s = len(lengths)
        args = (x, table, torch.zeros(s, dtype=torch.int64), None, 1.3, 0.8, iters, resample)
        recorder.launches.clear()
        cu.launch_segments(args, check(args))
        names = [launch["name"] for launch in recorder.launches]
        assert len(names) == launches_per_call(iters, resample)
        loop = ["dgc_seg_count", "dgc_seg_decide"] * iters
        exact = ["dgc_seg_exact_hist", "dgc_seg_pick"] * 4 if resample and iters else []
        want = ["dgc_seg_init", *["dgc_seg_sample_hist", "dgc_seg_pick"] * 4, *loop, *exact]
        assert names == [*want, "dgc_seg_tile_counts", "dgc_seg_scan", "dgc_seg_write"]
        tiles = sum(-(-n // tile) for n in lengths)
        rows = table.tolist()
        sblocks = sum(-(-(r[1] if r[4] == r[1] else r[4] + 1) // samp) for r in rows)
        grids = {launch["name"]: launch["dims"][0] for launch in recorder.launches}
        assert grids["dgc_seg_init"] == grids["dgc_seg_scan"] == s
        assert grids["dgc_seg_sample_hist"] == sblocks
        assert grids["dgc_seg_write"] == grids["dgc_seg_tile_counts"] == tiles
        assert all(launch["dims"][3] == 256 for launch in recorder.launches)
        assert all(launch["args"]["S"] == s and launch["args"]["T"] == tiles
                   for launch in recorder.launches)  # fmt: skip
        dependent = [bool(launch["attr"] and launch["attr"][1]) for launch in recorder.launches]
        assert dependent == [False] + [True] * (len(names) - 1)
        aux = cu._aux(check(args), x.device)[0].tolist()
        assert aux[: s + 1] == list(np.cumsum([0] + [-(-n // tile) for n in lengths]))


def _cuda_cases():
    g = torch.Generator().manual_seed(37)
    cases = [[1], [7, 4096, 4097, 8193], [15_000, 1, 2304, 40_000], [300_001, 17]]
    cases += [torch.randint(1, 30_000, (int(c),), generator=g).tolist() for c in (3, 20, 60)]
    return cases


_LOOPS = [(True, 10, False), (False, 10, True), (True, 20, True), (False, 3, False)]
_LOOPS += [(True, 0, False), (True, 1, True)]  # (resample, iters, uniform sampling)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "ramp", "special"])
@pytest.mark.parametrize("lengths", _cuda_cases())
def test_cuda_kernel_matches_the_reference(kind, lengths) -> None:
    starts, size = _layout(lengths, [j % 4 for j in range(len(lengths))])
    x = dgc_data(size, kind, len(lengths))
    for ratio, sr in ((0.001, 0.01), (0.01, 0.01), (0.3, 0.1), (1.0, 1.0), (0.0001, 0.01)):
        for resample, iters, uniform in _LOOPS:
            _run(x, lengths, starts, ratio, sr, 3, uniform, 1.3, 0.8, iters, resample, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("resample", [True, False])
@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("ratio", [0.001, 0.01])
def test_cuda_resnet50_bucket_matches_the_reference(resample, uniform, ratio) -> None:
    lengths = RESNET50_NUMELS
    starts, size = _layout(lengths, [0] * len(lengths))
    for kind in ("heavy", "normal", "ties"):
        x = dgc_data(size, kind, 50)
        _run(x, lengths, starts, ratio, 0.01, 5, uniform, 1.3, 0.8, 10, resample, "cuda")


@pytest.mark.cuda
def test_cuda_walks_resample_stops_and_reuse() -> None:
    x = torch.ones(10_000)  # the threshold walks up and down; then a resample stop
    for iters in range(8):
        for resample in (False, True):
            _run(x, [10_000], [0], 0.01, 0.01, 0, False, 1.3, 0.8, iters, resample, "cuda")
    y = torch.ones(30_000)
    y[9_900:10_000] = 2.0
    y[25_000:25_050] = -3.0
    for r in range(3):  # the same workspace, other tables and values
        _run(y, [10_000, 20_000], [0, 10_000], 0.01, 0.01, r, False, 1.3, 0.8, 10, True, "cuda")
        _run(y, [10_000, 20_000], [0, 10_000], 0.005, 0.01, r, True, 1.3, 0.8, 10, False, "cuda")
    table = dgc_segments_plan([10_000, 20_000], [0, 10_000], 0.01, 0.01).cuda()
    s0 = torch.zeros(2, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream: a workspace of its own
        v, i = dgc_segments_select(y.cuda(), table, s0)
    torch.cuda.synchronize()
    ev, ei = select(y.numpy(), table.tolist(), [0, 0], None, 1.3, 0.8, 10, True)
    np.testing.assert_array_equal(i.cpu().numpy(), ei)
    np.testing.assert_array_equal(v.double().cpu().numpy(), ev)


@pytest.mark.cuda
@pytest.mark.parametrize("programmatic", [True, False])
def test_cuda_calls_back_to_back_between_torch_kernels(programmatic) -> None:
    """Each launch after the first may start before the one before it ends (sm_90+): torch
    kernels that rewrite x right before and right after every call must not leak into it."""
    from aiak.ops import _driver

    lengths = RESNET50_NUMELS[:40]
    starts, size = _layout(lengths, [2] * len(lengths))
    rows = dgc_segments_plan(lengths, starts, 0.001, 0.01)
    table, s0 = rows.cuda(), torch.ones(len(lengths), dtype=torch.int64, device="cuda")
    data = [dgc_data(size, kind, 3) for kind in ("heavy", "ties", "normal")]
    want = [select(d.numpy(), rows.tolist(), [1] * len(lengths), None, 1.3, 0.8, 10, True)
            for d in data]  # fmt: skip
    dev = [d.cuda() for d in data]
    x = torch.empty_like(dev[0])
    previous = _driver.programmatic_launches(programmatic)
    try:
        got = []
        for r in range(9):
            x.copy_(dev[r % 3])
            got.append(dgc_segments_select(x, table, s0))
            x.neg_()  # a plain launch right after: it must wait for every kernel of the call
    finally:
        _driver.programmatic_launches(previous)
    for r, (v, i) in enumerate(got):
        ev, ei = want[r % 3]
        np.testing.assert_array_equal(i.cpu().numpy(), ei)
        np.testing.assert_array_equal(v.double().cpu().numpy(), ev)


@pytest.mark.cuda
def test_cuda_table_host_copy_follows_the_tensor_and_its_version() -> None:
    from aiak.ops import dgc_segments as ds

    lengths, starts = [20_000, 9_000], [0, 20_000]
    x = dgc_data(29_000, "heavy", 4)
    s0 = torch.zeros(2, dtype=torch.int64)
    table = dgc_segments_plan(lengths, starts, 0.01, 0.01).cuda()
    for ratio in (0.01, 0.001):  # rewritten in place: a new version, a new host copy
        table.copy_(dgc_segments_plan(lengths, starts, ratio, 0.01))
        v, i = dgc_segments_select(x.cuda(), table, s0.cuda())
        rows = table.tolist()
        ev, ei = select(x.numpy(), rows, [0, 0], None, 1.3, 0.8, 10, True)
        np.testing.assert_array_equal(i.cpu().numpy(), ei)
        np.testing.assert_array_equal(v.double().cpu().numpy(), ev)
        assert ds.host_plan(table, x.numel()).rows == rows
    with pytest.raises(ValueError, match="not inside x"):
        dgc_segments_select(x[:28_999].cuda(), table, s0.cuda())
