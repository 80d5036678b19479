"""A plain DDP script whose rank SLOW_RANK sleeps SLOW_SECONDS in every forward."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
if rank == int(os.environ["SLOW_RANK"]):
    model.register_forward_pre_hook(lambda m, a: time.sleep(float(os.environ["SLOW_SECONDS"])))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for _ in range(int(os.environ.get("STEPS", "12"))):
    x = torch.randn(8, 16)
    loss = ddp(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
