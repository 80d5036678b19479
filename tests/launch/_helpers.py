"""Running aiakrun and plain python under a hard time limit (the process group is killed), and
two "hosts" as network namespaces joined by a veth pair."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
AIAKRUN = [sys.executable, "-m", "aiak.launch.run"]
SITE = ROOT / "launch" / "_site"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any AIAK_/PERSEUS_ variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "PERSEUS_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_TIMEOUT_SECONDS="60")
    env.update(extra)
    return env


def run(argv: list[str], env: dict[str, str], limit: float = 240.0) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own session; on timeout the whole group is killed, then it raises."""
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"{argv} outlived {limit} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_namespaces(subnet: str, mbit: int | None = None) -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair named ``aiak0`` in both, at
    ``<subnet>.1`` and ``<subnet>.2``, each end's egress limited to ``mbit`` by ``tc tbf`` when
    given; yields their names and deletes them after. Skips (with the reason) without root,
    iproute2 or namespace support."""
    if shutil.which("ip") is None or (mbit and shutil.which("tc") is None):
        pytest.skip("iproute2's ip and tc are not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    a, b = f"aiak_a_{tag}", f"aiak_b_{tag}"
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
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((a, f"va{tag}", f"{subnet}.1"), (b, f"vb{tag}", f"{subnet}.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "aiak0")  # one NIC name on both hosts
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "aiak0")
            _ip("-n", ns, "link", "set", "aiak0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if mbit:  # each end shapes its egress: both directions at mbit (burst: 256 KiB)
                tc = ["tc", "qdisc", "replace", "dev", "aiak0", "root", "tbf"]
                tc += ["rate", f"{mbit}mbit", "burst", str(256 * 1024), "latency", "100ms"]
                try:
                    _ip("netns", "exec", ns, *tc)
                except subprocess.CalledProcessError as e:
                    pytest.skip(f"cannot rate-limit the veth: {e.stderr.decode().strip()}")
        yield a, b
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
