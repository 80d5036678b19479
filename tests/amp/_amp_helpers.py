"""Small models, data and AIAK-Training's documented training loop, shared by the amp tests
(and DDP workers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp


def conv_net(seed: int = 0) -> nn.Sequential:
    """A small conv net with BatchNorm (8x3x16x16 -> 10 classes)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def image_data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from a fixed random teacher, so the task is learnable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    teacher = torch.randn(3 * 16 * 16, 10, generator=g)
    return x, (x.flatten(1) @ teacher).argmax(1)


def fp32_twin(model: nn.Module, lr: float = 0.05) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An fp32 copy of ``model`` (before decorate) and its SGD, the reference run."""
    import copy

    twin = copy.deepcopy(model)
    return twin, torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9)


def seed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    clip: float | None = 1.0,
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """One iteration of AIAK-Training's documented loop on CPU (GradScaler optional, as with
    bf16)."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    if loss_hook is not None:
        loss = loss_hook(loss)
    if scaler is None:
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.parameters(optimizer), clip)
        optimizer.step()
        return loss.item()
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(amp.parameters(optimizer), clip)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def fp32_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float | None = 1.0,
) -> float:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.item()


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
