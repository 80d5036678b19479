"""What the four recipes share: their flags, the two set-ups they compare, and the step.

A recipe defines ``build(aiak, tiny, device, batch) -> Run``: with ``aiak=False`` what a user
picks without aiak (O1: torch.autocast + GradScaler, torch's optimizer), with ``aiak=True``
the aiak set-up (O2 by ``aiak.amp.decorate``, a fused optimizer, and the recipe's op).
``--compile`` wraps the model in ``torch.compile`` (``--compile-mode reduce-overhead``: with
CUDA graphs); ``--cuda-graphs`` keeps the model eager and replays its forward and backward from
CUDA graphs (:meth:`Run.graph`). Under ``aiakrun -np N`` (``WORLD_SIZE`` > 1) the model is
wrapped in DDP (the communication hooks come from aiakrun's flags): after graphing, before
compiling.
``benchmarks/bench_e2e.py`` builds the same runs and times them side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["COMPILE_MODES", "Run", "half_dtype", "main", "parse"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def half_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA (loss-scaled), bf16 on the CPU (CPU autocast's dtype; needs no scaler)."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


@dataclass
class Run:
    """One training set-up: ``step()`` is one iteration of the stock AMP loop."""

    model: nn.Module  # the module the optimizer trains (decorated when aiak)
    optimizer: torch.optim.Optimizer
    next_batch: Callable[[], Any]  # the next batch, on the device
    loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor]  # (forward, batch) -> loss
    device: torch.device
    scaler: torch.amp.GradScaler | None = None
    forward: Callable[..., Any] | None = None  # the model, compiled, graphed or DDP-wrapped
    graphed: bool = False

    def __post_init__(self) -> None:
        if self.forward is None:
            self.forward = self.model

    def compile(self, **kwargs: Any) -> Run:
        if self.graphed:
            raise ValueError("Run.compile: the model is already graphed (Run.graph)")
        self.forward = torch.compile(self.forward, **kwargs)
        return self

    def ddp(self, **kwargs: Any) -> Run:
        """Wraps the model in DistributedDataParallel (``kwargs`` go to DDP): after
        :meth:`graph`, before :meth:`compile` (``torch.compile`` of the DDP model)."""
        if self.forward is not self.model:
            raise ValueError("Run.ddp: wrap the model before torch.compile, and only once")
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.forward = nn.parallel.DistributedDataParallel(self.model, device_ids=ids, **kwargs)
        return self

    def graph(self) -> Run:
        """Replays the model's forward and backward from CUDA graphs, the model left eager
        (``torch.cuda.make_graphed_callables``): a step launches two graphs instead of the
        model's kernels one by one from Python, so a host-bound eager step (Swin-T) takes its
        kernels' time. The loss, the scaler and the optimizer stay eager. CUDA, the bare model
        (before torch.compile or DDP), and batches of the first batch's shapes.

        Under DDP, graph first and wrap after: DDP's reducer then sees each parameter's
        gradient when the backward graph's replay hands them to autograd, and its bucket
        allreduces (and any communication hook) run outside the graphs, after the whole
        backward: they no longer overlap it.

        The gradients the backward graph hands over are its own static buffers: a parameter
        whose ``.grad`` is None takes the buffer itself, which the next replay overwrites.
        :meth:`step` zeroes with ``set_to_none=True`` before every backward, so each step's
        gradients are read before they are overwritten; a loop that accumulates over several
        backwards must zero with ``set_to_none=False`` (autograd then adds into ``.grad``).
        """
        if self.device.type != "cuda":
            raise ValueError(f"Run.graph: CUDA graphs need a CUDA device, got {self.device}")
        if self.graphed or self.forward is not self.model:
            raise ValueError(
                "Run.graph: graph the bare model once, before torch.compile or DDP wrap it"
            )
        inputs: list[Any] = []

        def take(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                raise TypeError(
                    f"Run.graph: the loss calls the model with keywords {sorted(kwargs)}; "
                    "CUDA graphs take positional tensors"
                )
            inputs.extend(args)
            raise _InputsTaken

        with contextlib.suppress(_InputsTaken):
            self.loss_fn(take, self.next_batch())
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError("Run.graph: the model's inputs must be one or more tensors")
        # Clones: a graph copies each batch into its sample's storage, which must not be a
        # buffer the data pipeline reuses.
        sample = tuple(t.detach().clone() for t in inputs)
        # torch refuses autocast's weight-cast cache across graphs; O1's casts are then
        # captured inside the forward graph (O2's model runs with autocast off anyway).
        with torch.autocast(self.device.type, dtype=half_dtype(self.device), cache_enabled=False):
            self.forward = torch.cuda.make_graphed_callables(self.model, sample)
        self.graphed = True
        return self

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        batch = self.next_batch()
        with torch.autocast(self.device.type, dtype=half_dtype(self.device)):
            loss = self.loss_fn(self.forward, batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss.detach()


class _InputsTaken(Exception):
    """Stops :meth:`Run.graph`'s look at the model's inputs before the model runs."""


def scaler_for(device: torch.device, aiak: bool) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (CUDA); aiak's follows the O2 policy of decorated optimizers."""
    if device.type != "cuda":
        return None
    if aiak:
        import aiak.amp

        return aiak.amp.GradScaler("cuda")
    return torch.amp.GradScaler("cuda")


def parse(description: str, batch: int, tiny_batch: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--compile-mode",
        default=None,
        choices=COMPILE_MODES,
        help="torch.compile's mode (with --compile); reduce-overhead: CUDA graphs",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="eager model, forward and backward replayed from CUDA graphs (DDP: outside them)",
    )
    p.add_argument(
        "--aiak",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="aiak's set-up (default) or, with --no-aiak, torch's O1",
    )
    p.add_argument("--tiny", action="store_true", help="a small torch.nn model (CPU smoke run)")
    p.add_argument(
        "--batch", type=int, default=None, help=f"batch (default {batch}, tiny {tiny_batch})"
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.compile_mode and not args.compile:
        p.error("--compile-mode needs --compile")
    if args.cuda_graphs and args.compile:
        p.error(
            "--cuda-graphs and --compile exclude each other (CUDA graphs with compile: "
            "--compile --compile-mode reduce-overhead)"
        )
    if args.batch is None:
        args.batch = tiny_batch if args.tiny else batch
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graphs and args.device.type != "cuda":
        p.error(f"--cuda-graphs needs a CUDA device, got {args.device}")
    return args


def _maybe_ddp(run: Run) -> Callable[[], None]:
    """DDP under a launcher (WORLD_SIZE > 1); returns the clean-up to call at the end."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return lambda: None
    import torch.distributed as dist

    dist.init_process_group()
    run.ddp()

    def done() -> None:
        run.forward = None
        dist.destroy_process_group()

    return done


def main(build: Callable[..., Run], description: str, batch: int, tiny_batch: int) -> None:
    args = parse(description, batch, tiny_batch)
    device = args.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the graphs' capture runs on the current device
    run = build(aiak=args.aiak, tiny=args.tiny, device=device, batch=args.batch)
    if args.cuda_graphs:
        run.graph()  # before DDP wraps the model (Run.graph)
    done = _maybe_ddp(run)
    try:
        if args.compile:
            run.compile(mode=args.compile_mode)
        losses, t0 = [], None
        for i in range(args.steps):
            if i == min(2, args.steps - 1):  # compile and warm-up stay out of the time
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            losses.append(run.step())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timed = args.steps - min(2, args.steps - 1)
        ms = (time.perf_counter() - t0) * 1e3 / timed
        first, last = float(losses[0]), float(losses[-1])
        mode = ("aiak" if args.aiak else "O1") + (" + compile" if args.compile else "")
        mode += " + CUDA graphs" if args.cuda_graphs else ""
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"{mode}: loss {first:.4f} -> {last:.4f} over {args.steps} steps, {ms:.1f} ms/step"
            )
    finally:
        done()
