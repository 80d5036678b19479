"""Initializes the process group with the spelling named by ``SPELLING`` and checks an
all-reduce; rank 0 prints ``ok SPELLING backend=... world=...``. One spelling per launch: a
second init in one process would read the first one's addresses from the launcher's store.
``nccl_keyword`` and ``device_id`` need a CUDA device per rank and NCCL."""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import init_process_group


def init(spelling: str) -> None:
    if spelling == "positional":
        dist.init_process_group("gloo")
    elif spelling == "keyword":
        dist.init_process_group(backend="gloo")
    elif spelling == "init_method":
        dist.init_process_group(backend="gloo", init_method="env://")
    elif spelling == "init_method_positional":
        dist.init_process_group("gloo", "env://")
    elif spelling == "no_backend":
        dist.init_process_group()
    elif spelling == "timeout":
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=42))
    elif spelling == "imported_before":
        init_process_group(backend="gloo", world_size=int(os.environ["WORLD_SIZE"]))
    elif spelling == "nccl_keyword":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend="nccl")
    elif spelling == "device_id":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local))
    else:
        raise SystemExit(f"unknown spelling {spelling}")


spelling = os.environ["SPELLING"]
init(spelling)
device = "cuda" if dist.get_backend() == "nccl" else "cpu"
t = torch.ones(3, device=device) * (dist.get_rank() + 1)
dist.all_reduce(t)
world = dist.get_world_size()
assert t.tolist() == [world * (world + 1) / 2] * 3, t
if dist.get_rank() == 0:
    print(f"ok {spelling} backend={dist.get_backend()} world={world}", flush=True)
dist.destroy_process_group()
