"""Conformance of ``aiak::dgc_select``: DGC's fixed-k selection, exact against the algorithm.

Reference: the op's plain-PyTorch kernel on a CPU copy (integer comparisons of fp32 bit
patterns: exact, no rounding). Candidate: the op on the device. Baseline: ``torch.topk`` of
``|x|`` with the same k (what a DGC without sampling would run).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register

_SIZES = (
    ("odd 123457 r=0.001", 123_457, 0.001, True),
    ("odd 123457 r=0.01 no resample", 123_457, 0.01, False),
    ("tiny 7", 7, 0.3, True),
    ("tile edge 16385", 16_385, 0.001, True),
    ("25M r=0.001", 25_000_000, 0.001, True),
)


def _specs(device: torch.device) -> list[Spec]:
    return [
        Spec(label, torch.float32, {"n": n, "ratio": r, "resample": rs}, bench=n > 10**7)
        for label, n, r, rs in _SIZES
        if n <= 10**7 or device.type == "cuda"
    ]


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    n = p["n"]
    x = torch.randn(n, generator=gen)
    x[torch.randint(0, n, (max(1, n // 1000),), generator=gen)] *= 30  # heavy tail
    k = max(1, math.ceil(n * p["ratio"]))
    m = max(1, math.ceil(n * 0.01))
    stride = max(1, n // m)
    start = int(torch.randint(0, stride, (1,), generator=gen))
    args = (k, m, start, stride, None, 1.3, 0.8, 10, p["resample"])
    return {"x": x.to(device), "cpu": x, "args": args, "k": k}


def _candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    v, i = torch.ops.aiak.dgc_select(inp["x"], *inp["args"])
    return {"values": v, "indices": i}


def _reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    v, i = torch.ops.aiak.dgc_select(inp["cpu"], *inp["args"])
    return {"values": v, "indices": i}


def _baseline(inp: dict[str, Any]) -> None:
    torch.topk(inp["x"].abs(), inp["k"], sorted=False)


register(
    Case(
        name="ops.dgc_select",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        baseline=_baseline,
        exact=("values", "indices"),
        description="DGC selection (sample, threshold, adapt, compact) with fixed k, exact vs "
        "the plain-PyTorch algorithm; baseline torch.topk(|x|, k)",
    )
)
