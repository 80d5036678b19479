"""One NCCL rank (world 1) on a GPU: overlap_step's steps on the worker thread and a side stream
(the CUDA default) give the parameters of the plain loop. Prints one JSON line; run by
tests/comm/test_overlap_cuda.py."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from aiak import comm


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(256, 256) for _ in range(6)] + [nn.Linear(256, 8)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1]).cuda()


def train(mode: str, opt_fn) -> tuple[torch.Tensor, int]:
    net = model()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.3)
    opt = opt_fn(net)
    stepper = None
    if mode == "plain":
        comm.register(ddp, comm.allreduce())
    else:
        stepper = comm.overlap_step(ddp, opt, hook=comm.allreduce(), offload=mode == "offload")
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(6):
        x = torch.randn(64, 256, device="cuda", generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), torch.zeros(64, 8, device="cuda")).backward()
        if stepper is None:
            opt.step()
    torch.cuda.synchronize()
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    return flat, (stepper.steps if stepper is not None else 0)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("nccl", rank=0, world_size=1)
    out = {}
    opts = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=False),
        "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    }
    for name, opt_fn in opts.items():
        ref, _ = train("plain", opt_fn)
        for mode in ("offload", "inline"):
            got, steps = train(mode, opt_fn)
            out[f"{name}_{mode}"] = ((got - ref).norm() / ref.norm()).item()
            out[f"{name}_{mode}_steps"] = steps
    print(json.dumps(out), flush=True)
    comm.shutdown()
    comm.exit_rank(0)


if __name__ == "__main__":
    main()
