"""Conformance cases for aiak.optim: k-step parity (k = 10) with torch Adam/AdamW/SGD for every
option combination and dtype over two param groups; LAMB/FusedLAMB/LARS against float64
implementations of the reference math (apex FusedLAMB's update, aiak.optim.lars); GradScaler
with an injected inf (the step is skipped: params and state unchanged, step count included).

The float64 references live here (``lamb_reference``, ``lars_reference``) and the tests use
them too: one statement of the math, independent of aiak.optim's own code paths.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from aiak.conformance.harness import Case, Spec, register
from aiak.optim import LAMB, LARS, FusedAdam, FusedLAMB, FusedSGD

K = 10
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Around the 65,536-element chunk and the 4-element vector; an empty and a 1-element tensor.
SHAPES = [(3, 5), (7,), (1,), (0,), (65537,), (129, 513)]
GradFn = Callable[[int], list[torch.Tensor]]


# --------------------------------------------------------------------------------------------
# float64 references
# --------------------------------------------------------------------------------------------


def lamb_reference(
    params: list[torch.Tensor],
    grads: GradFn,
    steps: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    max_grad_norm: float = 1.0,
    use_nvlamb: bool = False,
) -> list[torch.Tensor]:
    """apex FusedLAMB's LAMB update in float64, one tensor at a time; the params after ``steps``."""
    b1, b2 = betas
    ps = [p.detach().double().cpu().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        gs = [g.detach().double().cpu() for g in grads(t)]
        norm = sum(float(g.pow(2).sum()) for g in gs) ** 0.5
        clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        b3 = 1 - b1 if grad_averaging else 1.0
        for p, g, m, v in zip(ps, gs, ms, vs):
            pn = float(p.norm())
            g = g / clip
            if not adam_w_mode:
                g = g + weight_decay * p
            m.mul_(b1).add_(b3 * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + weight_decay * p
            un = float(u.norm())
            adapt = (use_nvlamb or weight_decay != 0) and pn != 0 and un != 0
            p.sub_((lr * pn / un if adapt else lr) * u)
    return ps


def lars_reference(
    params: list[torch.Tensor],
    grads: GradFn,
    steps: int,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    exclude_1d: bool,
) -> list[torch.Tensor]:
    """aiak.optim.lars's math in float64; the params after ``steps``."""
    ps = [p.detach().double().cpu().clone() for p in params]
    bufs: list[torch.Tensor | None] = [None] * len(ps)
    for t in range(1, steps + 1):
        for i, (p, g) in enumerate(zip(ps, grads(t))):
            g = g.detach().double().cpu()
            pn, gn = float(p.norm()), float(g.norm())
            trust = 1.0
            if pn > 0 and gn > 0 and not (exclude_1d and p.dim() <= 1):
                trust = trust_coefficient * pn / (gn + weight_decay * pn + eps)
            d = trust * (g + weight_decay * p)
            bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + d
            p.sub_(lr * bufs[i])
    return ps


# --------------------------------------------------------------------------------------------
# Inputs and running
# --------------------------------------------------------------------------------------------


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    dtype = spec.dtype
    params = [torch.randn(s, generator=gen).to(device, dtype) for s in SHAPES]
    grads = {
        t: [torch.randn(s, generator=gen) * spec.params.get("grad_scale", 1.0) for s in SHAPES]
        for t in range(1, K + 1)
    }
    return {"params": params, "grads": grads, "spec": spec}


def _grad_fn(inputs: dict[str, Any], dtype: torch.dtype) -> GradFn:
    return lambda t: [g.to(dtype) for g in inputs["grads"][t]]


def _run(
    make: Callable[[list], torch.optim.Optimizer],
    inputs: dict[str, Any],
    dtype: torch.dtype | None = None,
    peaks: dict[str, float] | None = None,
) -> dict:
    """K steps of ``make``'s optimizer; the params and state after them. ``peaks`` receives
    each output's largest L2 norm over the steps."""
    ps = [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in inputs["params"]]
    groups = [{"params": ps[:3]}, {"params": ps[3:], **inputs["spec"].params.get("group2", {})}]
    opt = make(groups)
    for t in range(1, K + 1):
        for p, g in zip(ps, inputs["grads"][t]):
            p.grad = g.to(p.device, p.dtype)
        opt.step()
        if peaks is not None:
            for key, v in _outputs(ps, opt).items():
                peaks[key] = max(peaks.get(key, 0.0), float(v.double().norm()))
    return _outputs(ps, opt)


def _outputs(ps: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict:
    out = {f"p{i}": p.detach() for i, p in enumerate(ps)}
    for i, p in enumerate(ps):
        for key, v in opt.state[p].items():
            if key != "step":
                out[f"{key}{i}"] = v
    return out


def _rounding_floor(
    make: Callable[[dict[str, Any]], Callable[[list], torch.optim.Optimizer]],
) -> Callable[[dict[str, Any]], dict[str, float]]:
    """Per-output bounds from storage rounding, for half-precision specs (harness ``floor``).

    Each of the K steps stores a param or state tensor in the spec's dtype, off by up to half
    an ulp of its size then; so after K steps it may be K x eps/2 of the largest size it had
    off the float64 truth (bf16: 3.9%, fp16: 0.5%, the policy's bound). Against its final
    size that is large where values cancel towards zero: a one-element param of optim.sgd
    can end 2-10% off in bf16 (about one run in 5 without this floor, none in 100 seeds with
    it).
    The trajectory is torch's optimizer (``make(inputs)``) in float64.
    """

    def floor(inputs: dict[str, Any]) -> dict[str, float]:
        eps = torch.finfo(inputs["spec"].dtype).eps
        peaks: dict[str, float] = {}
        final = _run(make(inputs), inputs, torch.float64, peaks)
        bounds = {}
        for key, v in final.items():
            size = float(v.norm())
            if size > 0:
                bounds[key] = K * eps / 2 * peaks[key] / size
        return bounds

    return floor


def _fused_available(device: torch.device) -> bool:
    return device.type == "cuda"


# --------------------------------------------------------------------------------------------
# Adam / AdamW, SGD: parity with torch
# --------------------------------------------------------------------------------------------


def _adam_specs(device: torch.device) -> list[Spec]:
    out = []
    for dtype, (adam_w, amsgrad, maximize, wd) in itertools.product(
        DTYPES, itertools.product([False, True], [False, True], [False, True], [0.0, 0.1])
    ):
        opts = {
            "adam_w": adam_w,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "wd": wd,
            "group2": {"lr": 3e-3},
        }
        name = f"{str(dtype).removeprefix('torch.')} {'adamw' if adam_w else 'adam'}"
        label = f"{name} amsgrad={amsgrad} maximize={maximize} wd={wd}"
        out.append(Spec(label, dtype, opts))
    return out


def _adam_kwargs(spec: Spec) -> dict[str, Any]:
    o = spec.params
    return {"lr": 1e-2, "weight_decay": o["wd"], "amsgrad": o["amsgrad"], "maximize": o["maximize"]}


def _adam_candidate(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    kw = _adam_kwargs(spec)
    return _run(lambda g: FusedAdam(g, adam_w_mode=spec.params["adam_w"], **kw), inputs)


def _adam_reference(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    cls = torch.optim.AdamW if spec.params["adam_w"] else torch.optim.Adam
    device = inputs["params"][0].device
    impl = (
        {"fused": True}
        if _fused_available(device) or spec.dtype != torch.float32
        else {"foreach": True}
    )
    return _run(lambda g: cls(g, **_adam_kwargs(spec), **impl), inputs)


register(
    Case(
        name="optim.adam",
        specs=_adam_specs,
        make_inputs=_inputs,
        candidate=_adam_candidate,
        reference=_adam_reference,
        description="FusedAdam/FusedAdamW vs torch Adam/AdamW (fused on CUDA), 10 steps, 2 groups",
    )
)

SGD_OPTIONS = [  # momentum, dampening, nesterov, weight_decay, maximize
    (0.0, 0.0, False, 0.0, False),
    (0.9, 0.0, False, 0.1, False),
    (0.9, 0.1, False, 0.0, True),
    (0.9, 0.0, True, 0.1, False),
    (0.5, 0.0, True, 0.0, True),
]


def _sgd_specs(device: torch.device) -> list[Spec]:
    return [
        Spec(
            f"{str(d).removeprefix('torch.')} m={m} damp={dp} nesterov={n} wd={wd} max={mx}",
            d,
            {
                "kw": {
                    "momentum": m,
                    "dampening": dp,
                    "nesterov": n,
                    "weight_decay": wd,
                    "maximize": mx,
                    "lr": 0.1,
                },
                "group2": {"lr": 0.05},
            },
        )
        for d, (m, dp, n, wd, mx) in itertools.product(DTYPES, SGD_OPTIONS)
    ]


def _sgd_reference(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    if _fused_available(inputs["params"][0].device):
        return _run(lambda g: torch.optim.SGD(g, **spec.params["kw"], fused=True), inputs)
    # On CPU: torch's fused SGD is wrong for fp16 in torch 2.13, and its foreach SGD rounds
    # every intermediate to fp16; torch's SGD in float64 is the truth the policy bounds.
    dtype = torch.float64 if spec.dtype != torch.float32 else None
    return _run(lambda g: torch.optim.SGD(g, **spec.params["kw"], foreach=True), inputs, dtype)


def _sgd_peer(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    impl = {"fused": True} if _fused_available(inputs["params"][0].device) else {"foreach": True}
    return _run(lambda g: torch.optim.SGD(g, **spec.params["kw"], **impl), inputs)


register(
    Case(
        name="optim.sgd",
        specs=_sgd_specs,
        make_inputs=_inputs,
        candidate=lambda inputs: _run(lambda g: FusedSGD(g, **inputs["spec"].params["kw"]), inputs),
        reference=_sgd_reference,
        # torch's SGD in the spec's dtype: after 10 half-precision steps a 1-element param or
        # momentum buffer that cancels to ~0 is 10-20% off the float64 truth for torch too.
        peer=_sgd_peer,
        floor=_rounding_floor(
            lambda inputs: lambda g: torch.optim.SGD(g, **inputs["spec"].params["kw"])
        ),
        description="FusedSGD vs torch SGD (fused on CUDA), 10 steps, 2 groups",
    )
)


# --------------------------------------------------------------------------------------------
# LAMB / FusedLAMB / LARS: float64 references (params compared)
# --------------------------------------------------------------------------------------------

LAMB_OPTIONS = [  # adam_w_mode, grad_averaging, bias_correction, use_nvlamb, wd, max_grad_norm
    (True, True, True, False, 0.01, 1.0),
    (True, True, True, True, 0.0, 1.0),
    (False, True, True, False, 0.01, 1.0),
    (True, False, False, False, 0.01, 1.0),
    (True, True, True, False, 0.01, 0.0),
]


def _lamb_specs(device: torch.device) -> list[Spec]:
    # fp32 only against float64. Half-precision params drift from the float64 math by more
    # than the policy, by design of the format, not of the kernel: LAMB moves each tensor by
    # ~lr of its norm per step (1e-2 here), about one bf16 ulp, so each store rounds away a
    # large part of the step (bf16: 2-3% after 10 steps); fp16 moments (kept in the param
    # dtype, as apex does) underflow for clipped grads. The tests check half-precision LAMB
    # against the same fp32 math (kernel vs the op's reference). Mixed precision runs on fp32
    # masters.
    out = []
    for d, (aw, ga, bc, nv, wd, mg) in itertools.product((torch.float32,), LAMB_OPTIONS):
        opts = {
            "lr": 1e-2,
            "betas": (0.9, 0.999),
            "eps": 1e-6,
            "weight_decay": wd,
            "adam_w_mode": aw,
            "grad_averaging": ga,
            "bias_correction": bc,
            "use_nvlamb": nv,
            "max_grad_norm": mg,
        }
        label = f"{str(d).removeprefix('torch.')} adamw={aw} avg={ga} bc={bc} nvlamb={nv} "
        out.append(Spec(label + f"wd={wd} clip={mg}", d, {"opts": opts, "grad_scale": 3.0}))
    return out


def _params_only(out: dict) -> dict:
    # One output, all params flattened: a tensor of a single element that the trajectory
    # brings near 0 would otherwise turn an fp32 rounding into a large relative error.
    return {
        "params": torch.cat([v.flatten().double().cpu() for k, v in out.items() if k[0] == "p"])
    }


def _flat(ps: list[torch.Tensor]) -> dict:
    return {"params": torch.cat([p.flatten() for p in ps])}


def _lamb_reference(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    ps = lamb_reference(inputs["params"], _grad_fn(inputs, spec.dtype), K, **spec.params["opts"])
    return _flat(ps)


for _name, _cls in (("optim.fused_lamb", FusedLAMB), ("optim.lamb", LAMB)):
    register(
        Case(
            name=_name,
            specs=_lamb_specs,
            make_inputs=_inputs,
            candidate=lambda inputs, c=_cls: _params_only(
                _run(lambda g: c(g, **inputs["spec"].params["opts"]), inputs)
            ),
            reference=_lamb_reference,
            description=f"{_cls.__name__} vs a float64 LAMB (apex math), 10 steps, 2 groups",
        )
    )


def _lars_specs(device: torch.device) -> list[Spec]:
    return [
        Spec(
            f"{str(d).removeprefix('torch.')} exclude_1d={ex}",
            d,
            {
                "opts": {
                    "lr": 0.5,
                    "momentum": 0.9,
                    "weight_decay": 1e-4,
                    "trust_coefficient": 0.02,
                    "eps": 1e-8,
                    "exclude_1d": ex,
                }
            },
        )
        for d, ex in itertools.product(DTYPES, [True, False])
    ]


def _lars_reference(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    ps = lars_reference(inputs["params"], _grad_fn(inputs, spec.dtype), K, **spec.params["opts"])
    return _flat(ps)


register(
    Case(
        name="optim.lars",
        specs=_lars_specs,
        make_inputs=_inputs,
        candidate=lambda inputs: _params_only(
            _run(lambda g: LARS(g, **inputs["spec"].params["opts"]), inputs)
        ),
        reference=_lars_reference,
        description="LARS vs a float64 LARS, 10 steps, 2 groups",
    )
)


# --------------------------------------------------------------------------------------------
# GradScaler with an injected inf: the step is skipped
# --------------------------------------------------------------------------------------------

_SKIP_MAKERS = {
    "adamw": lambda g: FusedAdam(g, lr=1e-2),
    "sgd": lambda g: FusedSGD(g, lr=0.1, momentum=0.9),
    "lamb": lambda g: LAMB(g, lr=1e-2, weight_decay=0.01),
    "lars": lambda g: LARS(g, lr=0.1),
}


def _skip_specs(device: torch.device) -> list[Spec]:
    return [
        Spec(f"{name} {str(d).removeprefix('torch.')}", d, {"opt": name})
        for name in _SKIP_MAKERS
        # fp16, not bf16: torch's GradScaler has no CUDA inf check for bf16 grads.
        for d in (torch.float32, torch.float16)
    ]


def _skip_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    params = [torch.randn(s, generator=gen).to(device, spec.dtype).requires_grad_() for s in SHAPES]
    opt = _SKIP_MAKERS[spec.params["opt"]](params)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    for _ in range(2):  # two good steps: state exists
        scale = scaler.scale(torch.ones((), device=device))
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen).to(device) * scale).to(p.dtype)
        scaler.step(opt)
        scaler.update()
    return {"params": params, "opt": opt, "scaler": scaler, "gen": gen}


def _snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict:
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for key, v in opt.state[p].items():
            out[f"{key}{i}"] = v.clone()
    return out


def _skip_candidate(inputs: dict[str, Any]) -> dict:
    params, opt, scaler = inputs["params"], inputs["opt"], inputs["scaler"]
    scale = scaler.scale(torch.ones((), device=params[0].device))
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=inputs["gen"]).to(p.device) * scale
        if i == 4:
            g[7] = float("inf")
        p.grad = g.to(p.dtype)
    scaler.step(opt)
    scaler.update()
    return _snapshot(params, opt)


register(
    Case(
        name="optim.grad_scaler_skip",
        specs=_skip_specs,
        make_inputs=_skip_inputs,
        candidate=_skip_candidate,
        reference=lambda inputs: _snapshot(inputs["params"], inputs["opt"]),
        exact=tuple(
            f"{k}{i}"
            for k in ("p", "step", "exp_avg", "exp_avg_sq", "momentum_buffer")
            for i in range(len(SHAPES))
        ),
        description="GradScaler step with an inf in a grad: params and state (step too) unchanged",
    )
)
