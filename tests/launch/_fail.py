"""A plain DDP script whose rank ``FAIL_RANK`` fails at step ``FAIL_STEP`` as ``FAIL_MODE`` says:
``raise`` (an exception), ``kill`` (SIGKILL), ``abort`` (SIGABRT), ``stop`` (SIGSTOP: hangs
without dying), ``once`` (raises in the first attempt only: torchrun's restart count 0).
The others train ``STEPS`` steps (default: until stopped)."""

import os
import signal

import torch
import torch.distributed as dist
from torch import nn

mode = os.environ["FAIL_MODE"]
fail_rank = int(os.environ.get("FAIL_RANK", "1"))
fail_step = int(os.environ.get("FAIL_STEP", "3"))
steps = int(os.environ.get("STEPS", "1000000"))
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
model = nn.Linear(8, 1)
ddp = nn.parallel.DistributedDataParallel(model)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
for step in range(steps):
    if rank == fail_rank and step == fail_step:
        if mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        if mode == "once" and attempt == 0:
            raise RuntimeError(f"injected failure on rank {rank}, attempt {attempt}")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "abort":
            os.abort()
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
    ddp(torch.randn(4, 8)).sum().backward()
if rank == 0:
    print(f"done {steps} steps, attempt {attempt}", flush=True)
dist.destroy_process_group()
