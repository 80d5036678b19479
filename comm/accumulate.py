"""Local gradient accumulation (Perseus's PERSEUS_ACCUMULATE_N_STEPS)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .env import parse_env

__all__ = ["Accumulator", "accumulate"]


class Accumulator:
    """Runs n-1 micro-steps under ``ddp.no_sync()`` (no communication), the n-th synced.

    Gradients are summed over the n micro-steps: divide the loss by ``n_steps`` for their mean.

        acc = accumulate(ddp_model, 4)
        for x, y in data:
            with acc:
                (loss_fn(ddp_model(x), y) / acc.n_steps).backward()
            acc.step(optimizer)  # steps and zeroes the gradients on every 4th micro-step
    """

    __slots__ = ("_ctx", "ddp", "micro", "n_steps")

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel, n_steps: int):
        self.ddp = ddp_model
        self.n_steps = n_steps
        self.micro = 0  # micro-steps run so far
        self._ctx: Any = None

    @property
    def sync_step(self) -> bool:
        """Whether the micro-step just run (or about to run) communicates."""
        return self.micro % self.n_steps == 0

    def __enter__(self) -> Accumulator:
        self.micro += 1
        self._ctx = contextlib.nullcontext() if self.sync_step else self.ddp.no_sync()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None

    def step(self, optimizer: torch.optim.Optimizer, zero_grad: bool = True) -> bool:
        """``optimizer.step()`` (and ``zero_grad``) after a synced micro-step; True if it did."""
        if self.micro == 0 or not self.sync_step:
            return False
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        return True


def accumulate(
    ddp_model: torch.nn.parallel.DistributedDataParallel, n_steps: int | None = None
) -> Accumulator:
    """An :class:`Accumulator`; ``n_steps`` defaults to ``PERSEUS_ACCUMULATE_N_STEPS`` (1)."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"accumulate: ddp_model must be DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    if n_steps is None:
        n_steps = parse_env().accumulate
    if isinstance(n_steps, bool) or not isinstance(n_steps, int):
        raise TypeError(f"accumulate: n_steps must be an int, got {type(n_steps).__name__}")
    if n_steps < 1:
        raise ValueError(f"accumulate: n_steps must be >= 1, got {n_steps}")
    return Accumulator(ddp_model, n_steps)
