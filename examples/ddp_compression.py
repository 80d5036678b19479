"""A small real DDP training run on gloo (CPU) with aiak.comm hooks.

    python examples/ddp_compression.py                      # 4 ranks as 2 "nodes" x 2
    AIAK_POWERSGD_COMPRESSION=1 AIAK_START_COMPRESS_ITER=10 python examples/ddp_compression.py

Without AIAK_*/PERSEUS_* variables it uses hierarchical allreduce with fp16 between nodes
(Perseus's PERSEUS_ALLREDUCE_DTYPE=2); with them, the hook they describe. It prints the loss
and the bytes each rank sent per step, split intra-/inter-node.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from aiak import comm

TIMEOUT_S = 300


def run(rank: int, world: int, per_node: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    env_hook = comm.from_env()
    hook = env_hook or comm.hierarchical(outer=comm.fp16_compress(scale=10))
    ddp = comm.ddp(model, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    acc = comm.accumulate(ddp)  # PERSEUS_ACCUMULATE_N_STEPS micro-steps per optimizer step
    gen = torch.Generator().manual_seed(rank)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1)) / 8
    for step in range(60):
        x = torch.randn(32, 64, generator=gen)
        with acc:
            loss = nn.functional.mse_loss(ddp(x), x @ teacher)
            (loss / acc.n_steps).backward()
        acc.step(opt)
        if rank == 0 and step % 10 == 9:
            b = hook.state.bytes_sent()
            print(
                f"step {step + 1:3d}  loss {loss.item():.4f}  "
                f"sent intra {b['intra'] / 1e3:.1f} kB  inter {b['inter'] / 1e3:.1f} kB"
            )
    comm.shutdown()  # releases the DDP model and hook state, then destroys the process group


def main() -> None:
    nodes, per_node = 2, 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        run, args=(nodes * per_node, per_node, port), nprocs=nodes * per_node, join=False
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # join() raises naming the rank if one fails; every rank is waited for with a limit
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
