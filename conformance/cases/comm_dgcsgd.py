"""Conformance case for aiak.comm.DGCSGD, DGC's optimizer: 10 steps over two param groups
against a float64 statement of its rule, one tensor at a time (``p -= lr * (g + w)``, ``w`` the
weight-decay term with momentum: ``buf = m * buf + wd * p``, ``buf = wd * p`` at the first step,
nesterov ``w = wd * p + m * buf``). DGCSGD itself runs foreach calls per device and dtype.

fp32 only: half-precision params are stored rounded at every step, so after ten of them their
distance to the float64 truth is the format's, not the step's (the same reason as the LAMB
cases); the tests compare DGCSGD with the per-tensor rule in the same dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.comm import DGCSGD
from aiak.conformance.cases.optim import K, _grad_fn, _inputs, _run
from aiak.conformance.harness import Case, Spec, register

OPTIONS = [  # momentum, weight_decay, nesterov
    (0.0, 0.0, False),
    (0.0, 0.1, False),
    (0.9, 0.1, False),
    (0.9, 0.1, True),
    (0.5, 0.01, True),
]


def dgcsgd_reference(
    params: list[torch.Tensor],
    lrs: list[float],
    grads: Any,
    steps: int,
    *,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DGCSGD's rule in float64, one tensor at a time: (params, momentum buffers) after
    ``steps``; ``lrs`` is each param's learning rate (its group's)."""
    ps = [p.detach().double().cpu().clone() for p in params]
    bufs: list[torch.Tensor | None] = [None] * len(ps)
    for t in range(1, steps + 1):
        for i, (p, g) in enumerate(zip(ps, grads(t))):
            d = g.double().cpu()
            if weight_decay:
                w = weight_decay * p
                if momentum:
                    b = bufs[i]
                    bufs[i] = w.clone() if b is None else momentum * b + w
                    w = w + momentum * bufs[i] if nesterov else bufs[i]
                d = d + w
            p.sub_(lrs[i] * d)
    return ps, [b for b in bufs if b is not None]


def _specs(device: torch.device) -> list[Spec]:
    return [
        Spec(
            f"float32 m={m} wd={wd} nesterov={n}",
            torch.float32,
            {
                "kw": {"lr": 0.1, "momentum": m, "weight_decay": wd, "nesterov": n},
                "group2": {"lr": 0.05},
            },
        )
        for m, wd, n in OPTIONS
    ]


def _flat(ps: list[torch.Tensor], bufs: list[torch.Tensor]) -> dict:
    # params and buffers each as one vector: a one-element tensor that the trajectory brings
    # near 0 would otherwise turn an fp32 rounding into a large relative error
    out = {"params": torch.cat([p.flatten().double().cpu() for p in ps])}
    if bufs:
        out["buffers"] = torch.cat([b.flatten().double().cpu() for b in bufs])
    return out


def _candidate(inputs: dict[str, Any]) -> dict:
    out = _run(lambda g: DGCSGD(g, **inputs["spec"].params["kw"]), inputs)
    n = len(inputs["params"])
    bufs = [out[f"momentum_buffer{i}"] for i in range(n) if f"momentum_buffer{i}" in out]
    return _flat([out[f"p{i}"] for i in range(n)], bufs)


def _reference(inputs: dict[str, Any]) -> dict:
    spec = inputs["spec"]
    kw = dict(spec.params["kw"])
    lr, lr2 = kw.pop("lr"), spec.params["group2"]["lr"]
    n = len(inputs["params"])
    lrs = [lr] * 3 + [lr2] * (n - 3)  # _run's groups: the first three params, then the rest
    ps, bufs = dgcsgd_reference(inputs["params"], lrs, _grad_fn(inputs, spec.dtype), K, **kw)
    return _flat(ps, bufs)


register(
    Case(
        name="comm.dgcsgd",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        description="aiak.comm.DGCSGD vs its rule in float64, per tensor, 10 steps, 2 groups",
    )
)
