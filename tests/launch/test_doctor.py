"""aiak-doctor on this machine: every row has a verdict, bad variables and NICs fail."""

from __future__ import annotations

import json
import os
import site
import socket

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


def test_values_aiak_refuses_at_use_fail_here():
    env = {
        "GLOO_TIMEOUT_SECONDS": "abc",
        "AIAK_WINDOW_ATTENTION_KERNEL": "foo",
        "NCCL_NET_GDR_LEVEL": "banana",
    }
    rows = _rows(env)
    assert rows["variables (comm)"].verdict == "fail"
    assert "GLOO_TIMEOUT_SECONDS must be a number of seconds" in rows["variables (comm)"].detail
    kernel = rows["AIAK_WINDOW_ATTENTION_KERNEL"]
    assert kernel.verdict == "fail" and "'foo'" in kernel.detail and "mma" in kernel.fix
    gdr = rows["NCCL_NET_GDR_LEVEL"]
    assert gdr.verdict == "fail" and gdr.detail == "'banana' is not a level NCCL knows"
    rows = _rows({"AIAK_NCCL_TIMEOUT_SECONDS": "-3", "AIAK_DISABLE_KERNELS": "yes"})
    assert "AIAK_NCCL_TIMEOUT_SECONDS must be" in rows["variables (comm)"].detail
    assert rows["AIAK_DISABLE_KERNELS"].verdict == "fail"
    bwd = _rows({"AIAK_WINDOW_ATTENTION_BWD": "fast"})["AIAK_WINDOW_ATTENTION_BWD"]
    assert bwd.verdict == "fail" and "alias_ldm_cp" in bwd.fix
    ok = {"AIAK_WINDOW_ATTENTION_KERNEL": "scalar", "AIAK_WINDOW_ATTENTION_BWD": "base"}
    rows = _rows({**ok, "AIAK_WINDOW_ATTENTION_FWD": "ldm", "NCCL_NET_GDR_LEVEL": "PHB"})
    assert not {"AIAK_WINDOW_ATTENTION_KERNEL", "AIAK_WINDOW_ATTENTION_BWD"} & set(rows)
    assert "AIAK_WINDOW_ATTENTION_FWD" not in rows
    assert rows["NCCL_NET_GDR_LEVEL"].verdict in ("ok", "warn")  # warn: RDMA without peermem


def test_version_and_whether_activation_works_here(monkeypatch):
    from aiak.launch.run import SITE_DIR

    rows = _rows({})
    assert rows["aiak"].verdict == "ok" and rows["aiak"].detail.startswith("version ")
    monkeypatch.setenv("PYTHONPATH", SITE_DIR)
    assert _rows({})["activation (AIAK_AUTO=1)"].verdict == "ok"
    monkeypatch.delenv("PYTHONPATH")
    row = _rows({})["activation (AIAK_AUTO=1)"]
    pth = any(
        os.path.isfile(os.path.join(f, "aiak-auto.pth"))
        for f in [*site.getsitepackages(), site.getusersitepackages()]
    )
    assert row.verdict == ("ok" if pth else "warn")
    if not pth:
        assert "aiak-auto.pth" in row.detail and SITE_DIR in row.fix


def test_hosts_and_the_rendezvous_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rows = {r.name: r for r in doctor.check_hosts("localhost:2,nosuchhost.invalid:2", port)}
        assert rows["host localhost"].verdict == "ok"
        assert rows["host nosuchhost.invalid"].verdict == "fail"
        assert rows[f"rendezvous port {port}"].verdict == "fail"  # taken on this machine
        # a "remote" first host (127.0.0.2 is this machine's loopback, not a local name)
        rows = {r.name: r for r in doctor.check_hosts("127.0.0.2:1", port, timeout=5)}
        assert rows[f"rendezvous port 127.0.0.2:{port}"].verdict == "fail"  # one listens
    rows = {r.name: r for r in doctor.check_hosts("127.0.0.2:1", port, timeout=5)}
    assert rows[f"rendezvous port 127.0.0.2:{port}"].verdict == "ok"  # refused: reachable
    assert rows["host 127.0.0.2"].verdict in ("ok", "warn")
    rows = {r.name: r for r in doctor.check_hosts("localhost:1", port)}
    assert rows[f"rendezvous port {port}"].verdict == "ok"
    assert doctor.check_hosts("a:x", port)[0].verdict == "fail"


def test_main_with_hosts(capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("AIAK_", "PERSEUS_", "NCCL_", "GLOO_")):
            monkeypatch.delenv(k)
    assert doctor.main(["-H", "nosuchhost.invalid:1", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "host nosuchhost.invalid" and r["verdict"] == "fail" for r in rows)
