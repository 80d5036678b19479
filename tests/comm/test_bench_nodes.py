"""benchmarks/bench_comm_nodes.py on CPU: 2 "nodes" as network namespaces, every mode one aiakrun
job with its flags only, gloo ranks; the script's own checks (lossless modes exact to 1e-5)
decide its exit code, and the bytes it reports agree with each other and the ring formula.

Needs root and iproute2 (``ip netns``); skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import gzip
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _need_netns() -> None:
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")


def test_nodes_bench_runs_every_kind_of_mode_on_cpu(tmp_path):
    _need_netns()
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_comm_nodes.py"), "--per-node", "1"]
    argv += ["--models", "tiny", "--modes", "flat,hierarchical+fp16,dgc-0.001", "--steps", "4"]
    argv += ["--no-csv", "--json", str(out), "--limit", "150", "--trace", str(tmp_path / "tr")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "PERSEUS_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on CPU even where a GPU exists
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"flat", "hierarchical+fp16", "dgc-0.001"}
    flat, fp16, dgc = rows["flat"], rows["hierarchical+fp16"], rows["dgc-0.001"]
    assert flat["rel_err"] <= 1e-5 and flat["check"] == "ok" and fp16["check"] == "ok"
    assert all(r["local_ms"] > 0 for r in rows.values())  # the no-exchange floor is timed
    # the backward call's host time is part of its step, in both steps
    assert all(0 < r["bwd_host_ms"] <= r["step_ms"] for r in rows.values())
    assert all(0 < r["local_bwd_host_ms"] <= r["local_ms"] for r in rows.values())
    for mode in rows:  # rank 0's trace of two more steps, each in a "step" range
        with gzip.open(tmp_path / "tr" / f"{mode}_tiny_rank0.json.gz", "rt") as f:
            names = [e.get("name") for e in json.load(f)["traceEvents"]]
        assert names.count("step") >= 2
    grads = flat["grad_bytes"]  # 3 x Linear(64, 64): 49,920 B
    # 2 nodes x 1 rank: the ring sends S per rank; the link carries that plus TCP framing
    assert flat["inter_bytes_per_step"] == 2 * grads and flat["intra_bytes_per_step"] == 0
    assert 2 * grads <= flat["link_tx_per_step"] < 1.2 * 2 * grads
    assert fp16["inter_bytes_per_step"] == grads  # half the bytes
    # DGC: k = 5 of 4096 per weight matrix as (fp32, int64) pairs, the biases dense
    assert dgc["inter_bytes_per_step"] == 2 * (3 * 5 * 12 + 3 * 64 * 4)


def test_a_stopped_run_keeps_its_finished_modes_and_removes_its_namespaces(tmp_path):
    """SIGTERM (what ``timeout`` sends) after the first mode: that mode's row is written, the
    running job is killed, the namespaces are gone, the exit code says the run is incomplete."""
    _need_netns()
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_comm_nodes.py"), "--per-node", "1"]
    argv += ["--models", "tiny", "--modes", "flat,dgc-0.001,hierarchical", "--steps", "2"]
    argv += ["--no-csv", "--json", str(out), "--limit", "150"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "PERSEUS_"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    seen, deadline = "", time.monotonic() + 300
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while "flat: " not in seen and time.monotonic() < deadline:
                if sel.select(timeout=5):
                    line = proc.stdout.readline()
                    if not line:
                        break
                    seen += line
        assert "flat: " in seen, seen[-4000:]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 1, seen + rest
    assert "stopped (signal 15)" in rest, rest[-4000:]
    modes = {r["mode"] for r in json.loads(out.read_text())}
    assert "flat" in modes and "hierarchical" not in modes, modes
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    assert f"aiaknode0-{proc.pid}" not in netns.stdout
    assert f"aiaknode1-{proc.pid}" not in netns.stdout
