"""Running aiakrun and plain python under a hard time limit (the process group is killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
