"""Slow-rank detection (Perseus's PERSEUS_PERF_CHECK_N_STEPS).

Each rank times its own forward + backward: from DDP's forward (a forward pre-hook on the DDP
module) to the call of the comm hook for the step's last bucket, i.e. the local compute before
the step's final wait on the network. The wall time of a whole step says nothing here: DDP's
allreduce makes every rank wait for the slowest, so all ranks see the same step time.

Every ``n_steps`` steps the ranks all-gather their mean time over the window; a rank whose mean
exceeds the median by more than ``margin`` (a fraction, 0.2 = 20 %) is reported on rank 0 with its
host and GPU, and on the slow rank itself. On CUDA the times are CUDA events on the current
stream: the host waits for the window's last event once per ``n_steps`` steps, never per step.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PerfCheck", "SlowRank", "slow_ranks", "watch"]

logger = logging.getLogger("aiak.comm")

_NAME_BYTES = 96  # "host GPU" per rank, UTF-8, zero-padded, gathered once


class SlowRank(tuple):
    """``(rank, where, mean_ms, median_ms)``; ``ratio`` is how many times the median."""

    __slots__ = ()

    def __new__(cls, rank: int, where: str, mean_ms: float, median_ms: float) -> SlowRank:
        return super().__new__(cls, (rank, where, mean_ms, median_ms))

    @property
    def ratio(self) -> float:
        return self[2] / self[3] if self[3] > 0 else float("inf")

    def __str__(self) -> str:
        rank, where, mean, med = self
        return (
            f"rank {rank} ({where}) is {100 * (self.ratio - 1):.0f}% slower than the median: "
            f"forward+backward {mean:.2f} ms vs {med:.2f} ms"
        )


def slow_ranks(times_ms: list[float], where: list[str], margin: float) -> list[SlowRank]:
    """The ranks whose time exceeds the median by more than ``margin`` (a fraction)."""
    if not times_ms:
        return []
    med = statistics.median(times_ms)
    return [
        SlowRank(r, where[r], t, med) for r, t in enumerate(times_ms) if t > med * (1.0 + margin)
    ]


def _where() -> str:
    host = socket.gethostname()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        i = torch.cuda.current_device()
        return f"{host} GPU {i} {torch.cuda.get_device_name(i)}"
    return f"{host} CPU"


class PerfCheck:
    """The per-DDP-model timer; :func:`watch` builds it. ``reports`` keeps every finding."""

    def __init__(self, ddp_model: Any, n_steps: int, margin: float) -> None:
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"watch: n_steps must be an int >= 1, got {n_steps!r}")
        if not 0 < margin < float("inf"):
            raise ValueError(f"watch: margin must be a finite number > 0, got {margin!r}")
        self.n_steps = n_steps
        self.margin = float(margin)
        self.group = ddp_model.process_group
        self.steps = 0  # completed (timed) steps
        self.reports: list[list[SlowRank]] = []
        self._where: list[str] | None = None
        self._start: Any = None
        self._spans: list[tuple[Any, Any]] = []
        self._cuda = False

    # -- timing -------------------------------------------------------------------------------
    def _mark(self) -> Any:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def forward_pre_hook(self, module: Any, args: Any) -> None:
        if self.steps and self.steps % self.n_steps == 0 and len(self._spans) >= self.n_steps:
            self.check()
        self._cuda = any(p.is_cuda for p in module.module.parameters())
        self._start = self._mark()

    def last_bucket(self) -> None:
        if self._start is None:  # backward without a forward through DDP (no_sync edge cases)
            return
        self._spans.append((self._start, self._mark()))
        self._start = None
        self.steps += 1

    def _mean_ms(self) -> float:
        spans, self._spans = self._spans, []
        if self._cuda:
            spans[-1][1].synchronize()  # the window's only host wait
            return sum(a.elapsed_time(b) for a, b in spans) / len(spans)
        return 1e3 * sum(b - a for a, b in spans) / len(spans)

    # -- exchange -----------------------------------------------------------------------------
    def check(self) -> list[SlowRank]:
        """All-gather the window's mean times (a collective); log and return the slow ranks."""
        mean = self._mean_ms()
        world = dist.get_world_size(self.group)
        dev = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            dev = torch.device("cuda", torch.cuda.current_device())
        if self._where is None:
            raw = _where().encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
            mine = torch.tensor(list(raw), dtype=torch.uint8, device=dev)
            names = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(names, mine, group=self.group)
            self._where = [bytes(n.tolist()).rstrip(b"\0").decode(errors="replace") for n in names]
        t = torch.tensor([mean], dtype=torch.float64, device=dev)
        times = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(times, t, group=self.group)
        values = [float(x.item()) for x in times]
        found = slow_ranks(values, self._where, self.margin)
        self.reports.append(found)
        me = dist.get_rank(self.group)
        for s in found:
            if me == 0 or s[0] == me:
                logger.warning(
                    "perf check, steps %d..%d: %s", self.steps - self.n_steps + 1, self.steps, s
                )
        return found


def watch(
    ddp_model: Any,
    n_steps: int,
    hook: Callable[..., Any] | None = None,
    state: Any = None,
    margin: float = 0.2,
) -> PerfCheck:
    """Time ``ddp_model``'s ranks and report slow ones every ``n_steps`` steps.

    Registers the comm hook: ``hook`` with ``state`` (already set up), or DDP's own allreduce
    when ``hook`` is None, behind a thin wrapper that notes the step's last bucket.
    """
    check = PerfCheck(ddp_model, n_steps, margin)
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook, state = default_hooks.allreduce_hook, ddp_model.process_group
    inner = hook

    def timed(st: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.is_last():
            check.last_bucket()
        return inner(st, bucket)

    # DDP checks these annotations as objects; this module's are strings (postponed).
    timed.__annotations__ = {
        "st": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    timed.__name__ = timed.__qualname__ = f"perf_check_{getattr(inner, '__name__', 'hook')}"
    ddp_model.register_forward_pre_hook(check.forward_pre_hook)
    ddp_model.register_comm_hook(state, timed)
    ddp_model._aiak_perf_check = check
    return check
