"""Conformance of ``aiak.ops.dgc_bucket``: DGC's selection over one bucket's many tensors.

Reference: the same torch ops on a CPU copy (integer comparisons of fp32 bit patterns and
integer counts: exact, no rounding but the threshold's fp32 steps, the same on every device).
Candidate: the bucket plan on the device. Baseline: ``torch.topk`` of ``|x|`` per tensor with
the same k (a per-tensor loop, what an exact top-k hook would run).
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.conformance.harness import Case, Spec, register
from aiak.ops.dgc_bucket import BucketPlan


def _resnet50_like() -> list[int]:
    """ResNet-50's conv / fc weight sizes (the tensors DGC compresses), in order."""
    sizes = [64 * 3 * 49]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            sizes += [width * cin, width * width * 9, 4 * width * width]
            if b == 0:
                sizes.append(4 * width * cin)
            cin = 4 * width
    return [*sizes, 1000 * 2048]


_LAYOUTS = (
    ("3 tensors, gaps, r=0.01", [5000, 123_457, 777], 3, 0.01, True),
    ("3 tensors r=0.01 no resample", [5000, 123_457, 777], 0, 0.01, False),
    ("tiny tensors r=0.3", [1, 7, 2, 64], 1, 0.3, True),
    ("ResNet-50 weights r=0.001", _resnet50_like(), 0, 0.001, True),
)


def _specs(device: torch.device) -> list[Spec]:
    return [
        Spec(label, torch.float32, {"sizes": s, "gap": g, "ratio": r, "resample": rs}, bench=True)
        for label, s, g, r, rs in _LAYOUTS
        if sum(s) <= 10**6 or device.type == "cuda"
    ]


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    segs, at = [], 0
    for n in p["sizes"]:
        at += p["gap"]
        segs.append((at, n))
        at += n
    x = torch.randn(at, generator=gen)
    x[torch.randint(0, at, (max(1, at // 1000),), generator=gen)] *= 30  # heavy tail
    plan = BucketPlan(segs, at, p["ratio"], 0.01, True, device)
    ref = BucketPlan(segs, at, p["ratio"], 0.01, True, torch.device("cpu"))
    u = torch.rand(len(segs), generator=gen, dtype=torch.float64)
    return {"x": x.to(device), "cpu": x, "u": u, "plan": plan, "ref": ref, "segs": segs,
            "k": plan.k, "resample": p["resample"]}  # fmt: skip


def _candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    plan = inp["plan"]
    u = inp["u"].to(plan.device)
    return {"indices": plan.select(inp["x"], u, 1.3, 0.8, 10, inp["resample"])}


def _reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"indices": inp["ref"].select(inp["cpu"], inp["u"], 1.3, 0.8, 10, inp["resample"])}


def _baseline(inp: dict[str, Any]) -> None:
    x = inp["x"]
    for (off, n), k in zip(inp["segs"], inp["k"]):
        torch.topk(x[off : off + n].abs(), k, sorted=False)


register(
    Case(
        name="ops.dgc_bucket",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        baseline=_baseline,
        exact=("indices",),
        description="DGC selection of every tensor of a bucket at once (fixed k per tensor), "
        "exact vs the same ops on CPU; baseline torch.topk(|x|, k) per tensor",
    )
)
