"""Spawn N gloo ranks on CPU as "nodes" x "ranks per node", with a hard time limit.

Each rank runs ``python tests/comm/_worker.py <suite> <out_dir>`` with torchrun's variables
(RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK) set so that ranks 2k, 2k+1 form
node k. Ranks write ``rank<r>.json``. Every rank's exit is checked
(``aiak.conformance.ranks.run_ranks``): one that aborts after writing its result still fails
the test, naming the rank, its signal and its output.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path

from aiak.conformance.ranks import RanksFailed, free_port, run_ranks

WORKER = Path(__file__).with_name("_worker.py")


def spawn(
    suite: str,
    out: Path,
    nodes: int = 2,
    per_node: int = 2,
    limit: float = 120.0,
    extra_env: dict[str, str] | None = None,
    may_fail: Collection[int] = (),
) -> dict[int, dict]:
    """Run the suite; returns each rank's results. ``may_fail``: ranks allowed a non-zero exit
    (a suite that kills one on purpose); any other failure raises ``RanksFailed``."""
    world = nodes * per_node
    port = free_port()

    def env(rank: int) -> dict[str, str]:
        e = dict(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(per_node),
            GROUP_RANK=str(rank // per_node),
            LOCAL_RANK=str(rank % per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_TIMEOUT_SECONDS=os.environ.get("GLOO_TIMEOUT_SECONDS", "30"),
        )
        e.update(extra_env or {})
        return e

    ranks = run_ranks(
        lambda r: [sys.executable, str(WORKER), suite, str(out)],
        world,
        env=env,
        limit=limit,
        log_dir=out,
        what=f"comm suite {suite!r}",
        check=False,
        grace=limit if may_fail else 10.0,
    )
    bad = [r for r in ranks if not r.ok and r.rank not in may_fail]
    if bad:
        raise RanksFailed(f"comm suite {suite!r}", ranks)
    results = {}
    for rank in range(world):
        f = out / f"rank{rank}.json"
        if f.exists():
            results[rank] = json.loads(f.read_text())
    return results


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.log")))
