"""Two "hosts" as network namespaces joined by a veth pair, each started by aiakrun through
``--remote-shell "ip netns exec {host} sh -c"``: the job rendezvouses across them and trains.

Needs root and iproute2 (``ip netns``); skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import AIAKRUN, ROOT, clean_env, run, two_namespaces

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture
def two_hosts():
    with two_namespaces("10.211.0") as hosts:
        yield hosts


def test_two_namespace_hosts_rendezvous_and_train(two_hosts):
    a, b = two_hosts
    env = clean_env(PERSEUS_GLOO_NETWORK_INTERFACE="aiak0", PERSEUS_MASTER_PORT="6666")
    argv = [*AIAKRUN, "-H", f"{a}=10.211.0.1:2,{b}=10.211.0.2:2", "--gloo"]
    argv += ["--hierarchical-allreduce", "--fp16-compression"]
    argv += ["--remote-shell", "ip netns exec {host} sh -c", "--rdzv-timeout", "120"]
    argv += ["--comm-log-steps", "10", "--", sys.executable, str(ROOT / "examples/ddp_plain.py")]
    out = run([*argv, "--steps", "20"], env, limit=280)
    assert out.returncode == 0, out.stdout[-6000:]
    assert "comm: DDP registered" in out.stdout
    loss = re.search(r"optimizer AdamW loss ([\d.]+) -> ([\d.]+)", out.stdout)
    assert loss and float(loss[2]) < float(loss[1])
    # 2 hosts x 2 ranks: the two-level hook sees two nodes (bytes cross between the namespaces)
    inter = re.findall(
        r"\[aiak rank 0\] step \d+: sent \d+ B intra-node, (\d+) B inter", out.stdout
    )
    assert inter and all(int(x) > 0 for x in inter)
    for ns in (a, b):  # no process left in either namespace
        left = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
        )
        assert left.stdout.strip() == ""
