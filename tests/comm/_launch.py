"""Spawn N gloo ranks on CPU as "nodes" x "ranks per node", with a hard time limit.

Each rank runs ``python tests/comm/_worker.py <suite> <out_dir>`` with torchrun's variables
(RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK) set so that ranks 2k, 2k+1 form
node k. Ranks write ``rank<r>.json``; a rank that outlives the limit is killed, never waited on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    suite: str,
    out: Path,
    nodes: int = 2,
    per_node: int = 2,
    limit: float = 120.0,
    extra_env: dict[str, str] | None = None,
) -> dict[int, dict]:
    world = nodes * per_node
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(per_node),
            GROUP_RANK=str(rank // per_node),
            LOCAL_RANK=str(rank % per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_TIMEOUT_SECONDS=env.get("GLOO_TIMEOUT_SECONDS", "30"),
        )
        env.update(extra_env or {})
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), suite, str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    deadline = time.monotonic() + limit
    for p, log in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    results = {}
    for rank in range(world):
        f = out / f"rank{rank}.json"
        if f.exists():
            results[rank] = json.loads(f.read_text())
    return results


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
