"""Start N rank processes, wait for every one of them with a deadline, and say which failed.

The launcher of aiak's multi-process conformance cases and tests. Each rank's output goes to a
log file (a pipe nobody reads can fill and block the rank); when a rank fails, the others get
a short grace period to fail on their own (they usually name the dead peer) and are then
killed; every process is waited for before returning. A failure reads, for example::

    rank 2 died with SIGABRT after 3.2 s
    --- rank 2 output (last 2000 characters)
    terminate called without an active exception
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["RankResult", "RanksFailed", "free_port", "run_ranks"]

TAIL_CHARS = 2000


class RanksFailed(RuntimeError):
    """One or more rank processes exited non-zero, died by a signal or timed out."""

    def __init__(self, what: str, results: Sequence[RankResult]) -> None:
        self.results = list(results)
        # the first to fail first: the others usually failed because of it
        bad = sorted((r for r in results if not r.ok), key=lambda r: (r.timed_out, r.seconds))
        lines = [f"{what}: {r.describe()}" for r in bad]
        for r in bad:
            lines.append(f"--- rank {r.rank} output (last {TAIL_CHARS} characters)\n{r.tail}")
        super().__init__("\n".join(lines))


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    seconds: float
    timed_out: bool
    log: Path
    tail: str = ""
    killed_because: str = ""  # why a rank still running was killed

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        if self.timed_out:
            return f"rank {self.rank} {self.killed_because} (killed after {self.seconds:.1f} s)"
        if self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"rank {self.rank} died with {name} after {self.seconds:.1f} s"
        return f"rank {self.rank} exited with code {self.returncode} after {self.seconds:.1f} s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    argv: Callable[[int], Sequence[str]],
    world: int,
    env: Callable[[int], Mapping[str, str]] | None = None,
    limit: float = 120.0,
    log_dir: str | Path | None = None,
    grace: float = 10.0,
    what: str = "ranks",
    check: bool = True,
) -> list[RankResult]:
    """Run ``argv(r)`` for r in ``range(world)`` with ``os.environ | env(r)``; wait for all.

    ``limit``: seconds for the whole set; a rank still running then is killed. ``grace``:
    seconds the others get after one fails, before they are killed. With ``check`` (default)
    a failed rank raises :class:`RanksFailed` naming it (exit code or signal, time, output tail).
    """
    if world < 1:
        raise ValueError(f"run_ranks: world must be >= 1, got {world}")
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="aiak-ranks-")
        log_dir = tmp.name
    log_dir = Path(log_dir)
    procs: list[tuple[subprocess.Popen, object, Path]] = []
    start = time.monotonic()
    ended: dict[int, float] = {}
    timed_out: dict[int, str] = {}
    try:
        for r in range(world):
            path = log_dir / f"rank{r}.log"
            log = open(path, "wb")  # noqa: SIM115 - closed in finally
            full_env = dict(os.environ)
            full_env.update(env(r) if env is not None else {})
            procs.append(
                (
                    subprocess.Popen(
                        list(argv(r)), env=full_env, stdout=log, stderr=subprocess.STDOUT
                    ),
                    log,
                    path,
                )
            )
        deadline = start + limit
        while len(ended) < world:
            now = time.monotonic()
            for r, (p, _, _) in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = now - start
            if len(ended) == world:
                break
            failed = sorted((r for r in ended if procs[r][0].returncode != 0), key=ended.get)
            if now > deadline:
                for r in range(world):
                    if r not in ended:
                        timed_out[r] = (
                            f"was still running {grace:g} s after rank {failed[0]} failed"
                            if failed
                            else f"did not finish within {limit:g} s"
                        )
                break
            if failed:
                deadline = min(deadline, start + ended[failed[0]] + grace)
            time.sleep(0.02)
    finally:
        for r, (p, log, _) in enumerate(procs):
            if p.poll() is None:
                p.kill()
            p.wait()
            ended.setdefault(r, time.monotonic() - start)
            log.close()
    results = []
    for r, (p, _, path) in enumerate(procs):
        text = path.read_text(errors="replace")
        results.append(
            RankResult(
                rank=r,
                returncode=None if r in timed_out else p.returncode,
                seconds=ended[r],
                timed_out=r in timed_out,
                log=path,
                tail=text[-TAIL_CHARS:],
                killed_because=timed_out.get(r, ""),
            )
        )
    if tmp is not None:
        tmp.cleanup()
    if check and not all(r.ok for r in results):
        raise RanksFailed(what, results)
    return results
