"""One rank of test_nccl.py's DGC check (run under torch.distributed.run, one GPU per rank).

The same model, data and DGC settings on CUDA over NCCL and on the CPU over gloo, in the same
processes: the CUDA selection is bit-exact with the CPU reference, so the averaged gradients of
every step must agree (the decode reads the allgather's output on NCCL's schedule, the case a
CPU test cannot reach). Prints one line per step; exits 1 on a mismatch.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiak import comm

STEPS = 4


def main() -> int:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(96, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    models = {"cuda": copy.deepcopy(model).to(dev), "cpu": model}
    ddps = {
        "cuda": DDP(models["cuda"], device_ids=[local], bucket_cap_mb=0.1),
        "cpu": DDP(models["cpu"], process_group=gloo, bucket_cap_mb=0.1),
    }
    for ddp in ddps.values():
        comm.register(ddp, comm.dgc(compress_ratio=0.01, momentum=0.9))
    gen = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    try:
        for step in range(STEPS):
            x, y = torch.randn(64, 96, generator=gen), torch.randn(64, 10, generator=gen)
            grads = {}
            for where, ddp in ddps.items():
                ddp.zero_grad(set_to_none=False)
                d = dev if where == "cuda" else torch.device("cpu")
                # a busy default stream: the decode must still wait for the allgather
                if where == "cuda":
                    torch.cuda._sleep(20_000_000)
                nn.functional.mse_loss(ddp(x.to(d)), y.to(d)).backward()
                grads[where] = torch.cat([p.grad.reshape(-1).cpu() for p in ddp.parameters()])
            err = float((grads["cuda"] - grads["cpu"]).abs().max())
            scale = float(grads["cpu"].abs().max())
            worst = max(worst, err / max(scale, 1e-30))
            print(f"rank {rank} step {step}: max |cuda - cpu| {err:.3e} (max |g| {scale:.3e})")
    finally:
        ddps.clear()  # the models before the groups they use
        comm.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    if worst > 1e-6:
        print(f"rank {rank}: FAIL, relative error {worst:.3e}")
        return 1
    print(f"rank {rank}: OK, relative error {worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
