"""Conformance cases for ``aiak::multi_tensor_l2norm`` and ``aiak::multi_tensor_scale_``."""

from __future__ import annotations

from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register, tolerance
from aiak.conformance.shapes import (
    BERT_LARGE,
    RESNET50,
    draw,
    poisoned_like,
    tensor_set,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Each variant: a label, a recipe for the tensor list (see tensor_set), CUDA-only/bench/large.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("mixed sizes [40]", {"sizes": "mixed", "n": 40}),
    ("odd single 123457", {"sizes": [123457]}),
    ("empty tensors among others", {"sizes": [0, 17, 0, 65536, 0]}),
    ("unaligned views", {"sizes": "mixed", "n": 12, "unaligned": True}),
    ("thousands of tiny [3000]", {"sizes": "tiny", "n": 3000}),
    ("chunk edges", {"sizes": [65535, 65536, 65537, 131072 + 3]}),
    ("resnet50-like [161]", {"sizes": RESNET50, "cuda": True, "bench": True}),
    ("bert-large-like [389]", {"sizes": BERT_LARGE, "cuda": True, "bench": True}),
    ("> 2^31 elements", {"sizes": [2**31 + 5], "cuda": True, "large": True}),
)


def _specs(device: torch.device, extra: tuple[tuple[str, dict[str, Any]], ...] = ()) -> list[Spec]:
    specs = []
    for dtype in DTYPES:
        for label, recipe in (*VARIANTS, *extra):
            if recipe.get("cuda") and device.type != "cuda":
                continue
            if recipe.get("large") and dtype == torch.float32:
                continue  # one 16-bit > 2^31 tensor (4 GiB) proves 64-bit indexing
            specs.append(
                Spec(
                    f"{str(dtype).removeprefix('torch.')} {label}",
                    dtype,
                    dict(recipe),
                    large=recipe.get("large", False),
                    bench=recipe.get("bench", False),
                )
            )
    return specs


# --------------------------------------------------------------------------------------------
# multi_tensor_l2norm
# --------------------------------------------------------------------------------------------


def _l2norm_specs(device: torch.device) -> list[Spec]:
    extra = (
        ("empty list", {"sizes": []}),
        ("mixed dtypes", {"sizes": "mixed", "n": 9, "mixed_dtypes": True}),
        ("non-dense views", {"sizes": "mixed", "n": 6, "strided": True}),
    )
    # The norm accumulates exactly representable inputs in fp32 whatever their dtype: the
    # fp32 reduction bound applies to every input dtype.
    return [
        Spec(s.label, s.dtype, s.params, large=s.large, bench=s.bench, tol=tolerance(torch.float32))
        for s in _specs(device, extra)
    ]


def _l2norm_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    return tensor_set(spec.params, spec.dtype, device, gen)


def _l2norm_reference(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    sq = (
        torch.stack([t.detach().double().square().sum().cpu() for t in tensors])
        if tensors
        else torch.zeros(0, dtype=torch.float64)
    )
    return {"total": sq.sum().sqrt(), "per_tensor": sq.sqrt()}


def _l2norm_candidate(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    total, per = torch.ops.aiak.multi_tensor_l2norm(tensors, True)
    return {"total": total, "per_tensor": per}


def _l2norm_baseline(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch.stack(torch._foreach_norm(tensors))
    return torch.linalg.vector_norm(norms), norms


register(
    Case(
        name="ops.multi_tensor_l2norm",
        specs=_l2norm_specs,
        make_inputs=_l2norm_inputs,
        candidate=_l2norm_candidate,
        reference=_l2norm_reference,
        baseline=_l2norm_baseline,
        description="global + per-tensor L2 norm of a tensor list vs a float64 sum of squares; "
        "baseline torch._foreach_norm + stack",
    )
)


# --------------------------------------------------------------------------------------------
# multi_tensor_scale_
# --------------------------------------------------------------------------------------------

# (src dtype, dst dtype) pairs beyond same-dtype: amp's grad unscale and master copy-back.
_CONVERSIONS = (
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
)


def _scale_specs(device: torch.device) -> list[Spec]:
    specs = []
    for s in _specs(
        device,
        (
            ("in place", {"sizes": "mixed", "n": 20, "in_place": True}),
            ("with inf and nan", {"sizes": "mixed", "n": 20, "nonfinite": True}),
        ),
    ):
        if s.large:
            # A 2^31-element float64 reference of every output would need ~50 GB of host
            # memory; tests/ops covers scale_'s 64-bit indexing on the GPU directly.
            continue
        specs.append(
            Spec(
                s.label,
                s.dtype,
                {**s.params, "dst_dtype": s.dtype},
                elementwise=True,
                large=s.large,
                bench=s.bench,
            )
        )
    for src, dst in _CONVERSIONS:
        for label, recipe in (
            ("mixed sizes [40]", {"sizes": "mixed", "n": 40}),
            ("unaligned views", {"sizes": "mixed", "n": 12, "unaligned": True}),
            ("bert-large-like [389]", {"sizes": BERT_LARGE, "cuda": True, "bench": True}),
        ):
            if recipe.get("cuda") and device.type != "cuda":
                continue
            name = f"{str(src).removeprefix('torch.')}->{str(dst).removeprefix('torch.')} {label}"
            # The output's dtype sets the bound: a product rounded once to it.
            specs.append(
                Spec(
                    name,
                    dst,
                    {**recipe, "src_dtype": src, "dst_dtype": dst},
                    elementwise=True,
                    bench=recipe.get("bench", False),
                )
            )
    return specs


def _scale_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    src_dtype = p.get("src_dtype", spec.dtype)
    src = tensor_set(p, src_dtype, device, gen)
    if p.get("nonfinite") and src:
        src[len(src) // 2].view(-1)[:1] = float("inf")
        src[-1].view(-1)[-1:] = float("nan")
    dst = src if p.get("in_place") else [poisoned_like(t, p["dst_dtype"]) for t in src]
    scale = draw((), gen, device, torch.float32).abs() + 0.5
    found = torch.zeros(1, dtype=torch.float32, device=device)
    # In place, the reference needs the values before the candidate overwrites them.
    before = [t.detach().double().cpu() for t in src]
    return {
        "src": src,
        "dst": dst,
        "scale": scale,
        "found_inf": found,
        "before": before,
        "dst_dtype": p["dst_dtype"],
    }


def _scale_reference(inp: dict[str, Any]) -> dict[str, Any]:
    s = inp["scale"].double().cpu()
    out = [(x * s).to(inp["dst_dtype"]) for x in inp["before"]]
    bad = any(not torch.isfinite(x).all() for x in inp["before"])
    return {"dst": out, "found_inf": torch.tensor([1.0 if bad else 0.0])}


def _scale_candidate(inp: dict[str, Any]) -> dict[str, Any]:
    torch.ops.aiak.multi_tensor_scale_(inp["src"], inp["dst"], inp["scale"], inp["found_inf"])
    return {"dst": inp["dst"], "found_inf": inp["found_inf"]}


def _scale_baseline(inp: dict[str, Any]) -> None:
    out = torch._foreach_mul(inp["src"], inp["scale"])
    torch._foreach_copy_(inp["dst"], out)


register(
    Case(
        name="ops.multi_tensor_scale_",
        specs=_scale_specs,
        make_inputs=_scale_inputs,
        candidate=_scale_candidate,
        reference=_scale_reference,
        baseline=_scale_baseline,
        exact=("found_inf",),
        description="dst = src * scale with dtype conversion and a non-finite flag vs float64; "
        "baseline torch._foreach_mul + _foreach_copy_",
    )
)
