"""aiakrun as torchrun on CPU (gloo): every common ``init_process_group`` spelling, failures
that name the rank (raised, killed, stopped), real restarts, one launch per node as a scheduler
starts them, and ``-H`` hosts in order."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import AIAKRUN, HERE, ROOT, clean_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _root_cause(out: str) -> str:
    """The "Root Cause" section of torch's failure table."""
    assert "Root Cause (first observed failure):" in out, out[-4000:]
    return out.split("Root Cause (first observed failure):", 1)[1]


@pytest.mark.parametrize(
    "spelling", ["positional", "keyword", "init_method", "no_backend", "imported_before"]
)
def test_init_spellings_under_aiakrun(spelling):
    out = run(
        [*AIAKRUN, "-np", "2", "--gloo", "--", PY, str(HERE / "_init.py")],
        clean_env(SPELLING=spelling),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert f"ok {spelling} backend=gloo world=2" in out.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("spelling", ["nccl_keyword", "device_id"])
def test_nccl_spellings_on_gpus(spelling):
    import torch

    n = min(torch.cuda.device_count(), 2)
    env = clean_env(SPELLING=spelling, AIAK_NCCL_TIMEOUT_SECONDS="120")
    out = run([*AIAKRUN, "-np", str(n), "--nccl", "--", PY, str(HERE / "_init.py")], env)
    assert out.returncode == 0, out.stdout[-4000:]
    assert f"ok {spelling} backend=nccl world={n}" in out.stdout
    assert "init_process_group() defaults to nccl and times out after 120 s" in out.stdout


def test_keyword_backend_under_torchrun_with_auto():
    env = clean_env(SPELLING="keyword", AIAK_AUTO="1", PYTHONPATH=str(ROOT / "launch" / "_site"))
    argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = run([*argv, str(HERE / "_init.py")], env)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "ok keyword backend=gloo world=2" in out.stdout
    assert "[aiak rank 0] optim: torch.optim.LAMB is aiak's LAMB" in out.stdout  # activated


def _fail(
    mode: str, limit: float = 240.0, **extra: str
) -> tuple[subprocess.CompletedProcess, float]:
    env = clean_env(FAIL_MODE=mode, **extra)
    t0 = time.monotonic()
    out = run([*AIAKRUN, "-np", "2", "--gloo", "--", PY, str(HERE / "_fail.py")], env, limit)
    return out, time.monotonic() - t0


def test_a_raising_rank_is_named_with_its_traceback():
    out, _ = _fail("raise")
    assert out.returncode == 1, out.stdout[-4000:]
    cause = _root_cause(out.stdout)
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", cause)
    assert re.search(r"exitcode\s+: 1 ", cause)
    assert "RuntimeError: injected failure on rank 1" in cause  # the traceback, unchanged script
    assert "host      : " in cause


def _failures(out: str) -> list[str]:
    """Each failed rank's entry of torch's failure table (the root cause included)."""
    assert "Failures:" in out, out[-4000:]
    table = out.split("Failures:", 1)[1]
    return re.split(r"^\[\d+\]:$", table, flags=re.M)[1:]


@pytest.mark.parametrize("mode, signal_name", [("kill", "SIGKILL"), ("abort", "SIGABRT")])
def test_a_killed_rank_exits_1_and_names_the_signal(mode, signal_name):
    out, _ = _fail(mode)
    assert out.returncode == 1, out.stdout[-4000:]  # never 247/250
    # The killed rank's entry names its signal. It is not always the "root cause": the peer's
    # collective fails at once on the reset connection and writes an error file, whose time can
    # precede the launcher's sighting of the signal (torch picks the earliest).
    killed = [f for f in _failures(out.stdout) if re.search(r"rank\s+: 1 \(local_rank: 1\)", f)]
    assert killed, out.stdout[-4000:]
    assert f"({signal_name})" in killed[0], killed[0]


def test_a_stopped_rank_makes_the_others_fail_within_the_timeout():
    # rank 1 stops (SIGSTOP) without dying: rank 0 waits in its all-reduce for
    # GLOO_TIMEOUT_SECONDS, which applies although the script passes no timeout=, then fails;
    # the launcher stops the stopped rank (SIGTERM, then SIGKILL after torch's 30 s).
    out, took = _fail("stop", GLOO_TIMEOUT_SECONDS="8")
    assert out.returncode == 1, out.stdout[-4000:]
    cause = _root_cause(out.stdout)
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)", cause)
    assert "Timed out waiting 8000ms" in cause
    assert "launch: init_process_group() defaults to gloo and times out after 8 s" in out.stdout
    assert took < 200, took  # without the timeout: torch's 30 minutes


def test_max_restarts_recovers_from_one_failure():
    env = clean_env(FAIL_MODE="once", STEPS="8")
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--max-restarts", "1"]
    out = run([*argv, "--", PY, str(HERE / "_fail.py")], env, limit=280)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "injected failure on rank 1, attempt 0" in out.stdout
    assert "done 8 steps, attempt 1" in out.stdout


def test_max_restarts_0_fails_on_the_same_failure():
    out, _ = _fail("once", STEPS="8")
    assert out.returncode == 1 and "done 8 steps" not in out.stdout


def test_two_nodes_started_one_by_one_as_a_scheduler_does():
    port = _free_port()
    procs = []
    for node in (0, 1):
        argv = [*AIAKRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"]
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        argv += ["--rdzv-id", "sched", "--gloo", "--rdzv-timeout", "200"]
        procs.append(
            subprocess.Popen(
                [*argv, "--", PY, str(HERE / "_where.py")],
                env=clean_env(),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=280)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    text = "".join(outs)
    assert [p.returncode for p in procs] == [0, 0], text[-6000:]
    found = re.findall(r"where rank=(\d) group_rank=(\d) local_rank=(\d) world=4", text)
    assert sorted(r for r, _, _ in found) == ["0", "1", "2", "3"], text[-4000:]
    assert sorted(g for _, g, _ in found) == ["0", "0", "1", "1"]


def test_hosts_in_order_and_start_up_lines_once_per_rank():
    # two "hosts" on this machine (both local names): each gets aiakrun as its node, the
    # first one named is node 0 and holds ranks 0-1 (torch's c10d order would be by address)
    env = clean_env(PERSEUS_MASTER_PORT=str(_free_port()))
    argv = [*AIAKRUN, "-H", "localhost:2,127.0.0.1:2", "--gloo"]
    out = run([*argv, "--", PY, str(HERE / "_where.py")], env, limit=280)
    assert out.returncode == 0, out.stdout[-4000:]
    found = re.findall(r"where rank=(\d) group_rank=(\d) local_rank=(\d) world=4", out.stdout)
    assert sorted(found) == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert out.stdout.count("[aiak rank 0] optim: torch.optim.LAMB is aiak's LAMB") == 1
    assert "[aiak rank " not in out.stdout.replace("[aiak rank 0]", "")


def test_a_failing_host_stops_the_launch():
    env = clean_env(PERSEUS_MASTER_PORT=str(_free_port()), FAIL_MODE="raise")
    argv = [*AIAKRUN, "-H", "localhost:1,127.0.0.1:1", "--gloo"]
    out = run([*argv, "--", PY, str(HERE / "_fail.py")], env, limit=280)
    assert out.returncode == 1, out.stdout[-4000:]
    assert "RuntimeError: injected failure on rank 1" in out.stdout
    assert re.search(r"aiakrun: host\(s\) failed: .*\(exit 1\); stopping the others", out.stdout)
