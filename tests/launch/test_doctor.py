"""aiak-doctor on this machine: every row has a verdict, bad variables and NICs fail."""

from __future__ import annotations

import json
import os

from aiak.launch import doctor

VERDICTS = {"ok", "warn", "fail", "info"}


def _rows(env):
    return {r.name: r for r in doctor.run_checks(env)}


def test_clean_environment_passes():
    rows = _rows({"PATH": os.environ.get("PATH", "")})
    assert {"GPUs", "NCCL", "network interfaces", "cupy"} <= set(rows)
    assert all(r.verdict in VERDICTS for r in rows.values())
    assert rows["AIAK_/PERSEUS_ variables"].detail == "none set"
    assert not [r for r in rows.values() if r.verdict == "fail"]


def test_bad_variables_and_missing_nic_fail_with_a_fix():
    env = {
        "AIAK_FP16_COMPRESSION": "1",
        "PERSEUS_ALLREDUCE_DTYPE": "2",
        "AIAK_FUSED_OPTIMIZER": "2",
        "NCCL_SOCKET_IFNAME": "nosuchnic0",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_IB_HCA": "mlx5_9",
    }
    rows = _rows(env)
    assert rows["variables (comm)"].verdict == "fail"
    assert "contradicts PERSEUS_ALLREDUCE_DTYPE=2" in rows["variables (comm)"].detail
    assert rows["variables (optim)"].verdict == "fail"
    assert rows["NCCL_SOCKET_IFNAME"].verdict == "fail" and "lo" in rows["NCCL_SOCKET_IFNAME"].fix
    assert rows["GLOO_SOCKET_IFNAME"].verdict == "ok"
    if not os.path.isdir("/sys/class/infiniband"):
        assert rows["NCCL_IB_HCA"].verdict == "fail"


def test_main_json_and_exit_status(capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("AIAK_", "PERSEUS_", "NCCL_", "GLOO_")):
            monkeypatch.delenv(k)
    assert doctor.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(set(r) == {"name", "verdict", "detail", "fix"} for r in rows)
    monkeypatch.setenv("PERSEUS_ALLREDUCE_STREAMS", "99")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "PERSEUS_ALLREDUCE_STREAMS must be in 1..12" in out and "FAIL" in out
