"""The seed's native-AMP loop in Apex O2 with one added line, on a small ResNet.

    python examples/amp_o2.py                       # CUDA if present (fp16), else CPU (bf16)
    torchrun --nproc-per-node 2 examples/amp_o2.py  # the same under DDP

Data is synthetic CIFAR-shaped images whose labels come from a fixed random teacher, so the
loss visibly falls. ``aiak.amp.install()`` provides AIAK-Training's spelling
``torch.cuda.amp.aiak_amp_decorate``; everything else is the stock torch AMP loop.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import aiak.amp


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet_small(width: int = 32, classes: int = 10) -> nn.Module:
    """A ResNet-8 for 32x32 images."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
        Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes),
    )  # fmt: skip


def synthetic_data(n: int, batch: int, device: torch.device, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    teacher = torch.randn(3 * 32 * 32, 10, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return [(xb.to(device), yb.to(device)) for xb, yb in zip(x.split(batch), y.split(batch))]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-norm", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(
        f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    aiak.amp.install()  # AIAK-Training's torch.cuda.amp.aiak_amp_* spellings, O2-aware GradScaler

    torch.manual_seed(0)  # the same initial model on every rank
    model = resnet_small(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    # The one added line (before DDP):
    model, optimizer = torch.cuda.amp.aiak_amp_decorate(model, optimizer, dtype=dtype)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    # bf16 needs no loss scaling; a disabled GradScaler keeps the loop identical.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    data = synthetic_data(args.batch * args.batches, args.batch, device, seed=rank)
    first = last = float("nan")
    for step in range(args.steps):
        input, target = data[step % len(data)]
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            output = model(input)
            loss = F.cross_entropy(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(torch.cuda.amp.aiak_amp_parameters(optimizer), args.max_norm)
        scaler.step(optimizer)
        scaler.update()
        last = loss.item()
        first = last if step == 0 else first
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.4f}  scale {scaler.get_scale():.0f}")
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} ({dtype}, {device})")
    aiak.amp.uninstall()
    if distributed:
        # DDP models let go of the group before it is destroyed (see aiak.comm.shutdown).
        from aiak import comm

        comm.shutdown()
    return last / first


if __name__ == "__main__":
    main()
