"""Conformance of ``aiak::cast_scale_``: ``dst = src * scale`` in fp32, rounded once to dst."""

from __future__ import annotations

from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register
from aiak.conformance.shapes import draw, poisoned_like

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# (src, dst): comm's fp16/bf16 wire in both directions, and same-dtype scaling.
_PAIRS = (
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float16, torch.bfloat16),
)
_SIZES = (
    ("odd 123457", 123457, {}),
    ("tiny 7", 7, {}),
    ("empty", 0, {}),
    ("unaligned view", 65_541, {"offset": 3}),
    ("64 MB bucket 16M", 1 << 24, {"cuda": True, "bench": True}),
)


def _specs(device: torch.device) -> list[Spec]:
    specs = []
    for src, dst in _PAIRS:
        for label, n, extra in _SIZES:
            if extra.get("cuda") and device.type != "cuda":
                continue
            params = {"src": src, "dst": dst, "n": n, "offset": extra.get("offset", 0)}
            # The output's dtype sets the bound: a product rounded once to it.
            specs.append(
                Spec(
                    f"{_NAMES[src]}->{_NAMES[dst]} {label}",
                    dst,
                    params,
                    elementwise=True,
                    bench=extra.get("bench", False),
                )
            )
    return specs


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    off, n = p["offset"], p["n"]
    # Gradient-sized values (1e-4), where fp16 needs the scale; a view at an odd offset
    # cannot take the kernel's vector path.
    src = (draw(n + off, gen, device) * 1e-4).to(p["src"])[off:]
    dst = poisoned_like(torch.empty(n + off, device=device), p["dst"])[off:]
    scale = float(torch.empty(()).uniform_(2.0, 64.0, generator=gen))
    # The baseline's factor: a one-element fp32 tensor makes torch.mul compute in fp32.
    factor = torch.full((1,), scale, device=device)
    return {"src": src, "dst": dst, "scale": scale, "factor": factor, "before": src.double().cpu()}


def _reference(inp: dict[str, Any]) -> dict[str, Any]:
    s = torch.tensor(inp["scale"], dtype=torch.float32).double()
    return {"dst": (inp["before"] * s).to(inp["dst"].dtype)}


def _candidate(inp: dict[str, Any]) -> dict[str, Any]:
    torch.ops.aiak.cast_scale_(inp["dst"], inp["src"], inp["scale"])
    return {"dst": inp["dst"]}


def _baseline(inp: dict[str, Any]) -> None:
    # What aiak.comm's fp16 hook runs: one TensorIterator kernel computing in fp32.
    torch.mul(inp["src"], inp["factor"], out=inp["dst"])


register(
    Case(
        name="ops.cast_scale_",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        baseline=_baseline,
        description="dst = src * scale computed in fp32 and rounded once to dst's dtype vs "
        "float64; baseline torch.mul(src, fp32 factor, out=dst) (aiak.comm's cast)",
    )
)
