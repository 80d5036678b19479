"""A plain DDP script whose rank 1 kills itself (SIGKILL) at step 3 while the others train."""

import os
import signal

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.Linear(8, 1)
ddp = nn.parallel.DistributedDataParallel(model)
for step in range(10_000):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    ddp(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
