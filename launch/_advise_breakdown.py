"""aiak-advise's attribution: the probe's rank reports in, one step's :class:`Breakdown` out.

Pure functions of the reports (``_advise_probe``), tested without starting any process; the
cost model that turns a breakdown into advice is ``_advise_model``. docs/advise.md states
every rule used here.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HOST_BOUND", "PHASES", "Breakdown", "breakdown"]

PHASES = ("data", "compute", "comm", "optimizer", "other")
# A phase is host-bound when at least this share of its time is the host's, not its work.
HOST_BOUND = 0.5


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """One step, attributed (seconds: trimmed means over the measured steps, mean over ranks)."""

    step: float
    data: float
    data_epoch_start: float
    forward: float
    backward: float
    comm: float
    optimizer: float
    host: Mapping[str, float]  # phase -> the share of its time its ops cost the host
    gpu_idle: float | None  # share of boundary samples with the GPU's queue empty (CUDA only)
    facts: Mapping[str, Any]
    ranks: int
    steps: int
    # "gpu": data, forward, backward, optimizer and (where the comm hooks recorded events)
    # comm are intervals between CUDA events recorded at their boundaries (the GPU's clock);
    # "host": host time (the CPU, or CUDA without events)
    clock: str = "host"
    host_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # host times

    @property
    def compute(self) -> float:
        """Forward and backward, without the communication the backward did not hide."""
        return max(0.0, self.forward + self.backward - self.comm)

    @property
    def other(self) -> float:
        """The loop's own code between the phases (zero_grad, logging, ``.item()``); on the
        GPU's clock, the GPU's work queued by that code and its wait for that code's host
        time, while a host blocked in ``.item()`` counts where the GPU is busy."""
        used = self.data + self.forward + self.backward + self.optimizer
        return max(0.0, self.step - used)

    def share(self, phase: str) -> float:
        return getattr(self, phase) / self.step if self.step > 0 else 0.0

    def comm_split(self) -> tuple[float, float]:
        """(seconds the exposed comm spends moving bytes, seconds it waits for other ranks),
        from the link timed at the end of the run; all of it is bytes when no link was timed."""
        link = self.facts.get("link")
        if not link:
            return self.comm, 0.0
        buckets = max(1, int(self.facts.get("buckets", 1)))
        moved = int(self.facts.get("grad_bytes", 0)) * float(link["s_per_byte"])
        wait = max(0.0, self.comm - buckets * float(link["latency_s"]) - moved)
        return min(self.comm, moved), wait

    def host_floor(self) -> float:
        """The host's own work per step, a lower bound: its data, forward, backward and
        optimizer times without the backward's exposed comm (the host's waits for the
        communication). On the CPU it is the step less comm and "other"; on CUDA the GPU's
        step cannot be shorter, whatever the link: the host must still queue the step."""
        h = self.host_s
        if not h:
            return 0.0
        work = sum(float(h.get(k, 0.0)) for k in ("data", "forward", "backward", "optimizer"))
        return max(0.0, work - float(h.get("comm", 0.0)))

    def bottleneck(self) -> str:
        """The largest phase, named for what limits it: data, host, compute, link, ranks
        (the exposed comm is mostly ranks waiting for each other), optimizer, or loop (the
        script's own code between phases)."""
        phase = max(PHASES, key=self.share)
        if phase == "compute":
            idle = self.gpu_idle is not None and self.gpu_idle >= HOST_BOUND
            return "host" if idle or self.host.get("compute", 0.0) >= HOST_BOUND else "compute"
        if phase == "comm" and self.comm_split()[1] > self.comm / 2:
            return "ranks"
        return {"comm": "link", "other": "loop"}.get(phase, phase)

    def as_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in ("step", "data", "data_epoch_start", "forward")}
        d.update(backward=self.backward, comm=self.comm, optimizer=self.optimizer)
        d.update(compute=self.compute, other=self.other, host=dict(self.host))
        d.update(gpu_idle=self.gpu_idle, ranks=self.ranks, steps=self.steps)
        d.update(clock=self.clock, host_s=dict(self.host_s))
        d["shares"] = {p: round(self.share(p), 4) for p in PHASES}
        d["bottleneck"] = self.bottleneck()
        return d


_KEYS = ("step", "data", "data_epoch_start", "forward", "backward", "comm", "optimizer")


def _typical(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Means over the steps left after dropping the fastest and slowest fifth (by step time):
    robust to a stray slow step, and the phases still add up to the step."""
    ordered = sorted(records, key=lambda r: float(r.get("step", 0.0)))
    cut = len(ordered) // 5
    kept = ordered[cut : len(ordered) - cut] or ordered
    return {k: statistics.fmean(float(r.get(k, 0.0)) for r in kept) for k in _KEYS}


def breakdown(reports: Sequence[Mapping[str, Any]]) -> Breakdown:
    """Medians per rank, then the mean over ranks; ``ValueError`` when no step was measured."""
    if not reports:
        raise ValueError("reports: no rank wrote a report")
    used = [r for r in reports if r.get("records")]
    if not used:
        seen = max(int(r.get("steps_seen", 0)) for r in reports)
        warm = max(int(r.get("warmup", 0)) for r in reports)
        raise ValueError(
            f"reports: no measured step: the script finished {seen} optimizer step(s), the "
            f"warm-up is {warm}; a step is one optimizer.step() call"
        )
    host_rank = [_typical(r["records"]) for r in used]
    hmean = {k: statistics.fmean(p[k] for p in host_rank) for k in _KEYS}
    # CUDA: every measured step has its phases on the GPU's clock (events the probe read)
    gpu_clock = all("gpu" in rec for r in used for rec in r["records"])
    if gpu_clock:
        per_rank = [_typical([_on_gpu_clock(rec) for rec in r["records"]]) for r in used]
        mean = {k: statistics.fmean(p[k] for p in per_rank) for k in _KEYS}
    else:
        mean = hmean
    r0 = min(used, key=lambda r: r.get("rank", 0))
    cost = float(r0.get("op_cost_s", 0.0))
    ops = r0.get("ops", {})
    work = r0.get("work", {})
    rates = r0.get("rates", {})
    host = {
        # the optimizer: its ops' fixed host cost (what a multi-tensor update saves)
        "optimizer": _share(ops.get("optimizer", 0) * cost, hmean["optimizer"]),
        # forward + backward: what their work (elements written, multiply-adds at this
        # machine's rates) does not explain is the host's
        "compute": 1.0
        - _share(
            sum(
                work.get(p, (0, 0))[0] * rates.get("elem_s", 0.0)
                + work.get(p, (0, 0))[1] * rates.get("mac_s", 0.0)
                for p in ("forward", "backward")
            ),
            hmean["forward"] + hmean["backward"] - min(hmean["comm"], hmean["backward"]),
        ),
    }
    samples = sum(int(r.get("stream_samples", 0)) for r in used)
    empty = sum(int(r.get("stream_empty", 0)) for r in used)
    gpu_idle = (empty / samples) if samples and r0.get("cuda") else None
    if r0.get("cuda"):
        # the CPU's rates say nothing of GPU work: the GPU's empty queue is the host's share
        host["compute"] = gpu_idle or 0.0
    facts = dict(r0.get("facts", {}))
    opt_n = sum(int(r.get("opt_samples", 0)) for r in used)
    opt_empty = sum(int(r.get("opt_empty", 0)) for r in used)
    facts.update(
        world=int(r0.get("world", 1)),
        local_world=int(r0.get("local_world", 1)),
        backend=r0.get("backend"),
        cuda=bool(r0.get("cuda", False)),
        op_cost_s=cost,
        ops=dict(ops),
        rates=dict(rates),
        amp={k: list(v) for k, v in r0.get("amp", {}).items()},
        # share of steps whose GPU queue was empty when the optimizer started
        opt_queue_empty=(opt_empty / opt_n) if opt_n and r0.get("cuda") else None,
    )
    return Breakdown(
        step=mean["step"],
        data=mean["data"],
        data_epoch_start=min(mean["data_epoch_start"], mean["data"]),
        forward=mean["forward"],
        backward=mean["backward"],
        comm=min(mean["comm"], mean["backward"]),
        optimizer=mean["optimizer"],
        host=host,
        gpu_idle=gpu_idle,
        facts=facts,
        ranks=len(used),
        steps=min(len(r["records"]) for r in used),
        clock="gpu" if gpu_clock else "host",
        host_s={k: hmean[k] for k in ("data", "forward", "backward", "comm", "optimizer")},
    )


def _on_gpu_clock(rec: Mapping[str, Any]) -> dict[str, float]:
    """A step's phases on the GPU's clock; the step itself stays the host's (they agree over
    several steps: the GPU finishes one step per step). The exposed comm is the GPU's too
    (the comm hooks' events: from the last hook's call to the backward's end, the compute
    stream waits for the communication); a report without it keeps the host's. Either is
    bounded by the backward's GPU interval, which contains it."""
    g = rec["gpu"]
    out = {k: float(g.get(k, 0.0)) for k in ("data", "data_epoch_start", "forward", "backward")}
    out["optimizer"] = float(g.get("optimizer", 0.0))
    out["step"] = float(rec.get("step", 0.0))
    comm = g["comm"] if "comm" in g else rec.get("comm", 0.0)
    out["comm"] = min(float(comm), out["backward"])
    return out


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0
