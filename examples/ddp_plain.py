"""A plain DDP training script: torch only, no other library.

    torchrun --nproc-per-node 4 examples/ddp_plain.py [--steps N] [--sgd M] [--save PATH]

It trains a small MLP on a synthetic regression task and prints the loss on rank 0. Launchers
may switch features on around it through the environment; the script itself stays as it is.
``--sgd M`` trains with SGD (momentum M, weight decay 1e-4) instead of AdamW. ``--save`` writes
rank 0's final parameters and optimizer type (for comparisons).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sgd", type=float, default=None, metavar="MOMENTUM")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    dist.init_process_group()  # the backend for the device: gloo on CPU, nccl on CUDA
    rank = dist.get_rank()
    device = torch.device("cpu")
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    ).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.sgd is None:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=args.sgd, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(rank)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1)) / 8
    first = last = None
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        x, y = x.to(device), (x @ teacher).to(device)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.item()
        first = value if first is None else first
        last = value
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {value:.4f}", flush=True)
    if rank == 0:
        print(f"optimizer {type(opt).__name__} loss {first:.4f} -> {last:.4f}", flush=True)
        if args.save:
            torch.save(
                {
                    "params": [p.detach().cpu() for p in model.parameters()],
                    "optimizer": type(opt).__name__,
                },
                args.save,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
