"""Initializes the process group with the spelling named by ``SPELLING``, then all-reduces."""

import datetime
import os

import torch
import torch.distributed as dist

spelling = os.environ["SPELLING"]
if spelling == "positional":
    dist.init_process_group("gloo")
elif spelling == "keyword":
    dist.init_process_group(backend="gloo")
elif spelling == "init_method":
    dist.init_process_group(backend="gloo", init_method="env://")
elif spelling == "init_method_positional":
    dist.init_process_group("gloo", "env://")
elif spelling == "device_id":
    dist.init_process_group(backend="gloo", device_id=torch.device("cpu"))
elif spelling == "no_backend":
    dist.init_process_group()
elif spelling == "timeout":
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=42))
elif spelling == "from_import":
    from torch.distributed import init_process_group

    init_process_group(backend="gloo", world_size=int(os.environ["WORLD_SIZE"]))
else:
    raise SystemExit(f"unknown SPELLING {spelling}")
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
world = dist.get_world_size()
assert t.tolist() == [world * (world + 1) / 2] * 3, t
if dist.get_rank() == 0:
    print(f"ok {spelling} backend={dist.get_backend()} world={world}", flush=True)
dist.destroy_process_group()
