"""aiak.comm on 4 gloo CPU processes arranged as 2 "nodes" x 2 ranks.

One spawned group runs every check of ``_worker.suite_main`` (process start-up dominates);
the tests below assert on what each rank recorded. Tolerances are relative L2 errors against
DDP without a hook in the same process group (measured values in comments).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("comm_main")
    results = _launch.spawn("main", out, limit=240)
    assert sorted(results) == list(range(WORLD)), "ranks did not report:\n" + _launch.logs(out)
    errors = {r: v["errors"] for r, v in results.items() if v.get("errors")}
    assert not errors, f"checks raised: {errors}\n" + _launch.logs(out)
    return results


def test_topology_from_torchrun_env(ranks):
    assert all(r["topology"] == [[0, 1], [2, 3]] for r in ranks.values())


# Measured on this 2-core CPU box: allreduce 0, hierarchical 5e-8, fp16 (scale 10) 3.8e-4,
# bf16 2.7e-3, powersgd with rank >= min(n, m) 3.4e-7 (then P Q^T reconstructs M exactly).
TOL = {
    "allreduce": 1e-6,
    "hierarchical": 1e-6,
    "multi_stream": 1e-6,
    "fp16": 1e-3,
    "hier_fp16_outer": 1e-3,
    "fp16_hier": 1e-3,
    "hier_fp16_inner": 1e-3,
    "hier_ms_fp16": 1e-3,
    "bf16": 1e-2,
    "powersgd_full": 1e-5,
    "hier_powersgd_full": 1e-5,
    "nan_hier_powersgd_full": 1e-5,
}
TOL.update({f"{k}+offload": TOL[k] for k in ("allreduce", "fp16", "hier_fp16_outer")})
TOL["fp16_scale1+offload"] = 1e-3
TOL["nan_hier_powersgd_full+offload"] = TOL["nan_hier_powersgd_full"]
TOL["nan_fp16"] = TOL["fp16"]
TOL.update(
    {
        "allreduce+coalesce2": 1e-6,
        "fp16+coalesce3": 1e-3,
        "multi_stream+coalesce2": 1e-6,
        "nan_fp16+coalesce2+offload": 1e-3,
        "hier_fp16_outer+coalesce2": 1e-3,
        "fp16_scale1": 1e-3,
        "fp16_scale1+view": 1e-3,
        "fp16_scale1+coalesce3": 1e-3,
        "fp16+view": 1e-3,
        "bf16+view": 1e-2,
    }
)


def test_coalesce_is_ignored_with_a_warning_by_trees_that_defer(ranks):
    # hierarchical launches its later stages from callbacks: holding them could pair
    # different buckets on different ranks, so it runs uncoalesced and says so.
    for r in ranks.values():
        assert any("coalesce=2 is ignored" in w for w in r["coalesce_ignored_warning"])


@pytest.mark.parametrize("name", sorted(TOL))
def test_hook_matches_ddp_without_hook(ranks, name):
    for rank, r in ranks.items():
        got = r[name]
        for key in ("grad0", "grad3", "params"):
            assert got[key] <= TOL[name], f"rank {rank} {name} {key}: {got[key]:.3g} > {TOL[name]}"


def test_hierarchical_is_not_trivially_flat(ranks):
    # The two-level path sums in another order than a flat ring: exact zero would mean the
    # hook silently ran DDP's own allreduce.
    assert ranks[0]["hierarchical"]["grad0"] > 0


def _padded(lengths: list[int], g: int) -> list[int]:
    return [-(-n // g) * g for n in lengths]


def test_bytes_flat_allreduce_ring(ranks):
    total = 4 * sum(ranks[0]["bucket_lengths"])
    for rank, r in ranks.items():
        b = r["bytes_allreduce"]
        assert b["intra"] + b["inter"] == 2 * (WORLD - 1) * total // WORLD
        # ring 0->1->2->3->0: ranks 1 and 3 send across the node boundary
        assert (b["inter"] > 0) == (rank in (1, 3))


@pytest.mark.parametrize(("name", "wire_bytes"), [("hierarchical", 4), ("hier_fp16_outer", 2)])
def test_bytes_hierarchical(ranks, name, wire_bytes):
    padded = sum(_padded(ranks[0]["bucket_lengths"], 2))
    for r in ranks.values():
        b = r["bytes_" + name]
        assert b["intra"] == 4 * padded  # reduce-scatter + allgather: (G-1)/G * S each
        assert b["inter"] == wire_bytes * padded // 2  # allreduce of the shard over 2 nodes


def test_bytes_powersgd_rank_formula(ranks):
    # min_compression_rate=0, rank 1: each (n x m) tensor sends n + m floats (a bias: n + 1)
    shapes = [(36, 13), (36, 1), (29, 36), (29, 1), (5, 29), (5, 1)]
    floats = sum(n + m for n, m in shapes)
    for r in ranks.values():
        b = r["bytes_powersgd_r1"]
        assert b["intra"] + b["inter"] == 2 * (WORLD - 1) * 4 * floats // WORLD


def test_powersgd_error_feedback_converges(ranks):
    # Linear regression, 120 steps; last-10-step mean loss. Measured: no hook 0.345,
    # PowerSGD r1 + EF 0.360, nan_check(hierarchical(outer=powersgd r2)) 0.347, r1 no EF 1.04.
    for rank, r in ranks.items():
        c = r["converge"]
        assert c["powersgd_r1"] <= 1.1 * c["none"], (rank, c)
        assert c["nan_hier_powersgd_r2"] <= 1.1 * c["none"], (rank, c)
        assert c["powersgd_r1_no_ef"] > 1.5 * c["none"], "the loss check cannot tell EF apart"


def test_pickle_mid_training_resumes_exactly(ranks):
    for r in ranks.values():
        assert r["pickle_groups_dropped"]
        assert r["pickle_error_buckets"] == 2  # error feedback memory travelled
        assert r["pickle_resume"] == 0.0


@pytest.mark.parametrize("key", ["nan_raise", "nan_raise_offload"])
def test_nan_check_raise_names_rank_and_parameters(ranks, key):
    for rank, r in ranks.items():
        msg = r[key]
        assert msg.startswith("FloatingPointError") or "FloatingPointError" in msg, msg
        assert f"rank {rank}" in msg and "'0.weight'" in msg, msg


def test_nan_check_skip_zeroes_only_the_bad_rank(ranks):
    for rank, r in ranks.items():
        assert r["nan_skip_err"] <= 1e-6
        assert r["nan_skip_count"] == (1 if rank == 1 else 0)
        assert bool(r["nan_skip_warned"]) == (rank == 1)
        if rank == 1:
            assert "rank 1" in r["nan_skip_warned"][0] and "0.weight" in r["nan_skip_warned"][0]


def test_accumulate_equals_one_big_batch(ranks):
    for r in ranks.values():
        assert r["acc_err"] <= 1e-6
        assert r["acc_stepped"] == [False, True]
        assert r["acc_hook_steps"] == 1  # the no_sync micro-step sent nothing


def test_killed_rank_makes_the_others_raise_within_timeout(tmp_path):
    timeout = 10
    results = _launch.spawn(
        "kill",
        tmp_path,
        # a hang guard only: start-up on a loaded 2-core machine alone can take ~50 s; the
        # timing under test is measured inside the ranks (kill_seconds)
        limit=240,
        extra_env={"GLOO_TIMEOUT_SECONDS": str(timeout)},
        may_fail=(3,),
    )
    assert 3 not in results  # it died
    assert sorted(results) == [0, 1, 2], _launch.logs(tmp_path)
    for rank, r in results.items():
        assert r["kill"] != "finished without error", rank
        assert "rank" in r["kill"], r["kill"]
        assert r["kill_seconds"] is not None and r["kill_seconds"] < timeout + 5, (rank, r)
