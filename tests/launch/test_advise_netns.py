"""aiak-advise on a really slow link: 2 "hosts" as network namespaces joined by a veth pair
that ``tc tbf`` limits to 20 Mbit/s, one gloo rank in each, started through aiakrun's
``--remote-shell "ip netns exec {host} sh -c"``. Nothing is simulated: the plain DDP example's
gradients cross the limited link, fp16 compression must come first and its verify must gain.

Needs root and iproute2 (``ip netns``, ``tc``); skipped, with the reason, where namespaces or
the rate limit cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import ROOT, clean_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MBIT = 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def slow_hosts():
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("iproute2's ip and tc are not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    a, b = f"aiak_adv_a_{tag}", f"aiak_adv_b_{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
    except subprocess.CalledProcessError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.skip(f"cannot create network namespaces: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", f"aa{tag}", "type", "veth", "peer", "name", f"ab{tag}")
        for ns, dev, addr in ((a, f"aa{tag}", "10.212.0.1"), (b, f"ab{tag}", "10.212.0.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "aiak0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "aiak0")
            _ip("-n", ns, "link", "set", "aiak0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # each end shapes its egress: both directions at MBIT (burst: 256 KiB)
            tc = ["tc", "qdisc", "replace", "dev", "aiak0", "root", "tbf"]
            tc += ["rate", f"{MBIT}mbit", "burst", str(256 * 1024), "latency", "100ms"]
            try:
                _ip("netns", "exec", ns, *tc)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot rate-limit the veth: {e.stderr.decode().strip()}")
        yield a, b
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


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
