"""aiak-advise on a really slow link: 2 "hosts" as network namespaces joined by a veth pair
that ``tc tbf`` limits to 20 Mbit/s, one gloo rank in each, started through aiakrun's
``--remote-shell "ip netns exec {host} sh -c"``. Nothing is simulated: the plain DDP example's
gradients cross the limited link, fp16 compression must come first and its verify must gain.

Needs root and iproute2 (``ip netns``, ``tc``); skipped, with the reason, where namespaces or
the rate limit cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import ROOT, clean_env, run, two_namespaces

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MBIT = 20


@pytest.fixture
def slow_hosts():
    with two_namespaces("10.212.0", mbit=MBIT) as hosts:
        yield hosts


def test_slow_link_between_two_hosts_advises_fp16_and_verifies_it(slow_hosts):
    a, b = slow_hosts
    env = clean_env(PERSEUS_GLOO_NETWORK_INTERFACE="aiak0", PERSEUS_MASTER_PORT="6671")
    argv = [sys.executable, "-m", "aiak.launch.advise", "--json", "--verify", "--steps", "8"]
    argv += ["--warmup-steps", "3", "--limit", "300"]
    argv += ["-H", f"{a}=10.212.0.1:1,{b}=10.212.0.2:1", "--gloo"]
    argv += ["--remote-shell", "ip netns exec {host} sh -c", "--rdzv-timeout", "120"]
    argv += ["--", sys.executable, str(ROOT / "examples/ddp_plain.py"), "--steps", "200"]
    out = run(argv, env, limit=900)
    assert out.returncode == 0, out.stdout[-6000:]
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    facts = doc["facts"]
    assert facts["world"] == 2 and facts["local_world"] == 1
    # the link timed at the end of the run: within a factor 2 of the tbf rate
    rate = 1 / facts["link"]["s_per_byte"]
    assert MBIT * 1e6 / 8 / 2 < rate < MBIT * 1e6 / 8 * 2, rate
    assert doc["breakdown"]["bottleneck"] == "link", doc["breakdown"]
    assert doc["advice"][0]["feature"] == "fp16 gradient compression"
    v = doc["verify"]
    assert v["how"] == "aiakrun --fp16-compression"
    assert v["after_s"] < 0.8 * v["before_s"], v
    for ns in (a, b):  # no process left in either namespace
        left = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
        )
        assert left.stdout.strip() == ""
