"""aiak-advise scenario, link-bound: 2 ranks whose allreduce crosses a slow (simulated) link.

Simulated: ``ProcessGroup.allreduce`` sleeps ``bytes / --mbps`` before it issues the real
gloo allreduce, on the calling thread. Python comm hooks call it (torch's ``allreduce_hook``,
which aiak-advise registers to see the buckets, and aiak's hooks); DDP's built-in C++
allreduce does not, so without a Python hook this script is not slowed. The model is a 1M
parameter MLP trained by AdamW under DDP.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn


def slow_link(mbps: float) -> None:
    allreduce = dist.ProcessGroup.allreduce

    def delayed(self, tensors, *args, **kwargs):
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        time.sleep(nbytes / (mbps * 1e6))
        return allreduce(self, tensors, *args, **kwargs)

    dist.ProcessGroup.allreduce = delayed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mbps", type=float, default=50.0)
    args = parser.parse_args()
    slow_link(args.mbps)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(8, 512), torch.randn(8, 512)
    for _ in range(args.steps):
        loss = (ddp(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
