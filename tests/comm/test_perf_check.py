"""Slow-rank detection's pieces: the verdict and the variables (the run is in tests/launch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiak import comm
from aiak.comm.perf_check import slow_ranks


def test_slow_ranks_names_the_rank_its_place_and_how_much():
    where = ["h0 GPU 0", "h0 GPU 1", "h1 GPU 0", "h1 GPU 1"]
    found = slow_ranks([10.0, 10.5, 9.8, 16.0], where, margin=0.2)
    assert [s[0] for s in found] == [3]
    assert found[0][1] == "h1 GPU 1" and found[0].ratio == pytest.approx(16.0 / 10.25)
    assert "rank 3 (h1 GPU 1) is 56% slower" in str(found[0])
    assert slow_ranks([10.0, 11.9, 10.0], where[:3], margin=0.2) == []


@given(st.lists(st.floats(0.1, 1e4), min_size=1, max_size=64), st.floats(0.01, 5))
def test_slow_ranks_only_beyond_the_margin(times, margin):
    found = slow_ranks(times, [str(i) for i in range(len(times))], margin)
    med = sorted(times)[len(times) // 2] if len(times) % 2 else None
    for s in found:
        assert times[s[0]] > s[3] * (1 + margin)
        if med is not None:
            assert s[3] == med
    assert len(found) < len(times) or len(times) == 0  # the median rank is never slow


def test_perf_check_variables():
    cfg = comm.parse_env({"PERSEUS_PERF_CHECK_N_STEPS": "50", "AIAK_PERF_CHECK_MARGIN": "0.5"})
    assert cfg.perf_steps == 50 and cfg.perf_margin == 0.5
    assert comm.parse_env({}).perf_steps == 0
    with pytest.raises(ValueError, match="PERSEUS_PERF_CHECK_N_STEPS"):
        comm.parse_env({"PERSEUS_PERF_CHECK_N_STEPS": "-1"})
    with pytest.raises(ValueError, match="AIAK_PERF_CHECK_MARGIN"):
        comm.parse_env({"AIAK_PERF_CHECK_MARGIN": "0"})
