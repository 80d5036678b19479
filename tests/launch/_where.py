"""Prints each rank's node (torchrun's GROUP_RANK) and host address (the node's --local-addr
as torch's agent reports it), after one all-reduce; exits 0."""

import os

import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(
    f"where rank={dist.get_rank()} group_rank={os.environ['GROUP_RANK']} "
    f"local_rank={os.environ['LOCAL_RANK']} world={int(t.item())}",
    flush=True,
)
dist.destroy_process_group()
