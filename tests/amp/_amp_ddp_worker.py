"""The body of each rank of test_amp_ddp (spawned; importable by its module name)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from _amp_helpers import mlp
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp
from aiak import comm

STEPS = 3


def plain_mlp(seed: int = 0) -> nn.Sequential:
    """No BatchNorm: DDP's averaged grads then equal the full batch's, so a one-process run is
    the reference."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


def data(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def worker(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        x, y = data()
        shard = slice(rank * 8, rank * 8 + 8)
        results = {
            mode: train_ddp(plain_mlp(), x[shard], y[shard], mode, {})
            for mode in ("fp16", "bf16-accum")
        }
        # BatchNorm kept fp32 next to fp16 params: DDP buckets of two dtypes, grads as views.
        results["bn-bucket-view"] = train_ddp(
            mlp(), x[shard], y[shard], "fp16", {"gradient_as_bucket_view": True}
        )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        comm.shutdown()  # DDP models released before the group is destroyed


def train_ddp(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, ddp_kwargs: dict
) -> list[torch.Tensor]:
    """Decorate, then wrap in DDP, then train: the order AIAK-Training prescribes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.decorate(model, opt, dtype=torch.float16 if mode == "fp16" else torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    return run_loop(ddp, opt, x, y, mode)


def run_loop(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, mode: str
) -> list[torch.Tensor]:
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = amp.GradScaler("cpu") if mode == "fp16" else None
    for _ in range(STEPS):
        opt.zero_grad()
        if mode == "fp16":
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(amp.parameters(opt), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            (x0, y0), (x1, y1) = zip(x.chunk(2), y.chunk(2))
            no_sync = getattr(model, "no_sync", None)
            if no_sync is not None:
                with no_sync():
                    (F.cross_entropy(model(x0), y0) / 2).backward()
            else:
                (F.cross_entropy(model(x0), y0) / 2).backward()
            (F.cross_entropy(model(x1), y1) / 2).backward()
            opt.step()
    return [m.detach().clone() for m in amp.parameters(opt)]


def single_process(mode: str, n: int = 16) -> list[torch.Tensor]:
    """The reference: the same O2 training on the full batch in one process (two micro-batches
    of 8 average to the same gradient as two ranks of two micro-batches of 4)."""
    model = plain_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.decorate(model, opt, dtype=torch.float16 if mode == "fp16" else torch.bfloat16)
    x, y = data(n)
    return run_loop(model, opt, x, y, mode)
