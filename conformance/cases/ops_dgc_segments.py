"""Conformance of ``aiak::dgc_segments_select``: DGC's selection in every segment of a bucket,
exact against the per-segment algorithm.

Reference: the op's plain-PyTorch kernel on a CPU copy (integer comparisons of fp32 bit
patterns: exact, no rounding). Candidate: the op on the device. Baseline: the per-tensor
``aiak::dgc_select`` loop over the same segments (what the DGC hook runs without it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register
from aiak.conformance.shapes import RESNET50
from aiak.ops.dgc_segments import dgc_segments_plan

# (label, lengths, ratio, resample, uniform sampling)
_BUCKETS = (
    ("odd segments r=0.001", [123_457, 1, 4097, 70_001, 2304], 0.001, True, False),
    ("odd segments r=0.01 no resample", [123_457, 7, 4096, 33_333], 0.01, False, False),
    ("uniform samples r=0.01", [50_001, 20_000, 3], 0.01, True, True),
    ("tiny 7", [7], 0.3, True, False),
    ("ResNet-50 161 tensors r=0.001", None, 0.001, True, False),
)


def _specs(device: torch.device) -> list[Spec]:
    return [
        Spec(
            label,
            torch.float32,
            {"lengths": ls, "ratio": r, "resample": rs, "uniform": u},
            bench=ls is None,
        )
        for label, ls, r, rs, u in _BUCKETS
        if ls is not None or device.type == "cuda"
    ]


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    lengths = p["lengths"] or [math.prod(shape) for shape in RESNET50]
    starts, pos = [], 0
    for j, n in enumerate(lengths):
        pos += j % 3  # gaps: a bucket's dense tensors between the segments
        starts.append(pos)
        pos += n
    x = torch.randn(pos + 1, generator=gen)
    x[torch.randint(0, x.numel(), (max(1, x.numel() // 1000),), generator=gen)] *= 30
    plan = dgc_segments_plan(lengths, starts, p["ratio"], 0.01)
    rows = plan.tolist()
    s0 = torch.tensor([int(torch.randint(0, r[6], (1,), generator=gen)) for r in rows])
    sidx = None
    if p["uniform"]:
        sidx = torch.cat([r[0] + torch.randint(0, r[1], (r[4],), generator=gen) for r in rows])
    loop = (1.3, 0.8, 10, p["resample"])
    cpu = (x, plan, s0, sidx, *loop)
    dev = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in cpu)
    per_tensor = [(r[0], r[1], r[2], r[4], int(a), r[6]) for r, a in zip(rows, s0.tolist())]
    return {"cpu": cpu, "dev": dev, "per_tensor": per_tensor}


def _candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    v, i = torch.ops.aiak.dgc_segments_select(*inp["dev"])
    return {"values": v, "indices": i}


def _reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    v, i = torch.ops.aiak.dgc_segments_select(*inp["cpu"])
    return {"values": v, "indices": i}


def _baseline(inp: dict[str, Any]) -> None:
    x = inp["dev"][0]
    for start, n, k, m, a, stride in inp["per_tensor"]:
        torch.ops.aiak.dgc_select(x[start : start + n], k, m, a, stride, None, 1.3, 0.8, 10, True)


register(
    Case(
        name="ops.dgc_segments_select",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        baseline=_baseline,
        exact=("values", "indices"),
        description="DGC selection in every segment of a bucket, exact vs the plain-PyTorch "
        "algorithm; baseline the per-tensor aiak::dgc_select loop",
    )
)
