"""Conformance of ``aiak::window_attention``: Swin window attention, forward and gradients.

Every Swin-T stage shape (heads 3/6/12/24, windows per image 64/16/4/1, N = 49, D = 32) with and
without the shifted-window mask, fp16 and bf16, at odd batch counts, against a float64
reference. The bound per output is max(policy, 2x stock PyTorch's own error in the same dtype
(timm's unfused maths, autograd for the gradients)). The bias gradient sums thousands of
windows: its half-precision inputs bound how close any implementation can come.
"""

from __future__ import annotations

from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register
from aiak.conformance.shapes import draw
from aiak.ops.window_attention import window_attention

# (label, heads, windows per image, batch): Swin-T at 224, batches odd on purpose.
_STAGES = (
    ("stage1", 3, 64, 3),
    ("stage2", 6, 16, 5),
    ("stage3", 12, 4, 7),
    ("stage4", 24, 1, 9),
)
_N, _D = 49, 32
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _specs(device: torch.device) -> list[Spec]:
    specs = []
    for dtype in (torch.float16, torch.bfloat16):
        for label, heads, nw, batch in _STAGES:
            for masked in (False, True):
                specs.append(
                    Spec(
                        f"{label} b{batch} {'mask' if masked else 'no mask'} {_NAMES[dtype]}",
                        dtype,
                        {"heads": heads, "nw": nw, "batch": batch, "mask": masked},
                        bench=label == "stage1" and masked,
                    )
                )
        for label, heads, nw, batch in _STAGES[:3:2]:  # the [B_, N, nH, D] output Swin reads
            specs.append(
                Spec(
                    f"{label} b{batch} mask tokens_first {_NAMES[dtype]}",
                    dtype,
                    {"heads": heads, "nw": nw, "batch": batch, "mask": True, "tokens_first": True},
                )
            )
    return specs


def _swin_mask(nw: int, gen: torch.Generator) -> torch.Tensor:
    """0/-100 masks, one per window type, each row keeping at least its own token."""
    m = torch.where(torch.rand(nw, _N, _N, generator=gen) < 0.4, -100.0, 0.0)
    m[:, torch.arange(_N), torch.arange(_N)] = 0.0
    return m


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    windows = p["batch"] * p["nw"]
    shape = (windows, p["heads"], _N, _D)
    q, k, v = (draw(shape, gen, device, spec.dtype) for _ in range(3))
    bias = (0.5 * draw((p["heads"], _N, _N), gen, device)).float()  # fp32, as under autocast
    mask = _swin_mask(p["nw"], gen).to(device) if p["mask"] else None
    dout = draw(shape, gen, device, spec.dtype)
    return {
        "q": q,
        "k": k,
        "v": v,
        "bias": bias,
        "mask": mask,
        "dout": dout,
        "scale": _D**-0.5,
        "tokens_first": p.get("tokens_first", False),
    }


def _with_grads(inp: dict[str, Any], fn) -> dict[str, torch.Tensor]:
    leaves = {n: inp[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "bias")}
    out = fn(leaves)
    out.backward(inp["dout"].to(out.dtype))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    def attention(t: dict[str, torch.Tensor]) -> torch.Tensor:
        args = (t["q"], t["k"], t["v"], t["bias"], inp["mask"], inp["scale"])
        if inp["tokens_first"]:  # compared as [B_, nH, N, D]: the backward reads a strided grad
            return window_attention(*args, tokens_first=True).transpose(1, 2)
        return window_attention(*args)

    return _with_grads(inp, attention)


def _reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    d = {n: inp[n].double() for n in ("q", "k", "v", "bias", "dout")}
    mask = inp["mask"].double() if inp["mask"] is not None else None
    leaves = {n: d[n].clone().requires_grad_() for n in ("q", "k", "v", "bias")}
    out = _unfused(leaves, mask, inp["scale"])
    out.backward(d["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _unfused(t: dict[str, torch.Tensor], mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """timm's WindowAttention core, op by op, in the inputs' own dtypes."""
    q, k, v, bias = t["q"], t["k"], t["v"], t["bias"]
    windows, heads, n, _ = q.shape
    attn = (q * scale) @ k.transpose(-2, -1) + bias.unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        attn = attn.view(windows // nw, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(windows, heads, n, n)
    return attn.softmax(-1).to(v.dtype) @ v


def _peer(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _with_grads(inp, lambda t: _unfused(t, inp["mask"], inp["scale"]))


def _baseline(inp: dict[str, Any]) -> None:
    _peer(inp)


register(
    Case(
        name="ops.window_attention",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        peer=_peer,
        baseline=_baseline,
        description="Swin window attention (bias + shifted-window mask) and its gradients vs "
        "float64; peer/baseline: timm's unfused maths in the same dtype with autograd",
    )
)
