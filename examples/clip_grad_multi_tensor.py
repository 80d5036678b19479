"""Gradient clipping with two multi-tensor launches and no host synchronisation.

    python examples/clip_grad_multi_tensor.py [--device cuda] [--steps 200]

Trains a small MLP on two interleaved spirals twice from the same initial weights: once with
``torch.nn.utils.clip_grad_norm_``, once with ``aiak::multi_tensor_l2norm`` (the global norm,
on device) and ``aiak::multi_tensor_scale_`` (grads scaled in place by min(1, max/norm), a
device tensor: the step never waits for the GPU). Prints both losses; they agree.
"""

from __future__ import annotations

import argparse
import math

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*


def spirals(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.rand(n, generator=gen) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=gen)
    r = t / (3 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1)
    return x + 0.02 * torch.randn(x.shape, generator=gen), label


def clip_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    total, _ = torch.ops.aiak.multi_tensor_l2norm(grads, False)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # stays on device
    found_inf = torch.zeros(1, device=total.device)
    torch.ops.aiak.multi_tensor_scale_(grads, grads, coef, found_inf)
    return total


def train(clip: str, device: str, steps: int, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    x, y = spirals(2048, gen)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 2),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    params = list(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
        else:
            clip_(params, max_norm=0.5)
        opt.step()
    return torch.nn.functional.cross_entropy(model(x), y).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    ref = train("torch", args.device, args.steps)
    ours = train("aiak", args.device, args.steps)
    print(f"final loss: torch clip_grad_norm_ {ref:.5f}   aiak multi-tensor clip {ours:.5f}")


if __name__ == "__main__":
    main()
