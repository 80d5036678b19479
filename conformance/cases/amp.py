"""aiak.amp O2 vs fp32 training on the device at hand.

Reference: the same model trained in float64 (the policy's ground truth) for a few SGD steps.
Candidate: aiak.amp O2 (half model, fp32 masters; GradScaler for fp16). Compared: the weight
*update* (after - before), whose size the half precision actually affects (the weights
themselves are dominated by their initial values and would pass any tolerance), and the drop of
the loss since the first step. Stated tolerances, as O2 computes forward/backward in half
precision: relative L2 error <= 2e-2 for fp16 and <= 5e-2 for bf16 (measured on CPU over three
seeds: fp16 <= 5.6e-3, bf16 <= 1.8e-2).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp
from aiak.conformance.harness import Case, Spec, register

STEPS = 5
LR = 0.05
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _specs(device: torch.device) -> list[Spec]:
    dtypes = [torch.bfloat16, torch.float16]
    specs = [
        Spec(f"{kind}-{str(dtype).removeprefix('torch.')}", dtype, {"kind": kind}, tol=TOL[dtype])
        for kind in ("conv-bn", "mlp", "mlp-ln")
        for dtype in dtypes
    ]
    # patch_torch_functions=True: the user's autocast stays on inside the model (LayerNorm in
    # fp32 on CUDA); the default runs the model pure half, as apex O2.
    specs += [
        Spec(
            f"mlp-ln-{str(dtype).removeprefix('torch.')}-patch",
            dtype,
            {"kind": "mlp-ln", "patch": True},
            tol=TOL[dtype],
        )
        for dtype in dtypes
    ]
    return specs


def _model(kind: str, gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    if kind == "conv-bn":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
    if kind == "mlp-ln":
        return nn.Sequential(nn.Linear(48, 96), nn.LayerNorm(96), nn.GELU(), nn.Linear(96, 10))
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 10))


def _make_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    kind = spec.params["kind"]
    shape = (32, 3, 16, 16) if kind == "conv-bn" else (32, 48)
    patch = bool(spec.params.get("patch", False))
    x = torch.randn(shape, generator=gen)
    teacher = torch.randn(x[0].numel(), 10, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)
    return {
        "model": _model(kind, gen).to(device),
        "x": x.to(device),
        "y": y.to(device),
        "dtype": spec.dtype,
        "device": device,
        "patch": patch,
    }


def _flat(params: Any) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in params])


def _outputs(update: torch.Tensor, losses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    # The loss *drop* since step 0, like the weight update, measures the training itself: a
    # model that never receives its updates has a zero drop and fails, whatever the tolerance.
    curve = torch.stack(losses)
    return {"update": update, "loss_drop": curve - curve[0]}


def _reference(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(inputs["model"]).double()
    before = _flat(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = inputs["x"].double(), inputs["y"]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return _outputs(_flat(model.parameters()) - before, losses)


def _candidate(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    model, dtype, device = inputs["model"], inputs["dtype"], inputs["device"]
    before = _flat(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = amp.decorate(model, opt, dtype=dtype, patch_torch_functions=inputs["patch"])
    scaler = amp.GradScaler(device.type, enabled=dtype == torch.float16)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(inputs["x"]), inputs["y"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().double())
    return _outputs(_flat(amp.parameters(opt)) - before, losses)


register(
    Case(
        name="amp.o2_training",
        specs=_specs,
        make_inputs=_make_inputs,
        reference=_reference,
        candidate=_candidate,
        description="aiak.amp O2 (half model, fp32 masters) vs float64 SGD training, 5 steps",
    )
)
