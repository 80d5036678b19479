"""One rank of the compiled-DDP hook test (run by test_comm_compile.py; not collected).

For each hook, the same model and data train twice on this gloo group: eager DDP with the hook,
and ``torch.compile(ddp_model)`` with a fresh hook of the same kind (DDPOptimizer splits the
graph at DDP's buckets; DDP's reducer runs the hook as the compiled backward's pieces finish).
The gradients after each step and the final parameters are recorded; the pytest side asserts.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiak import comm

RANK = int(os.environ["RANK"])
# DDPOptimizer requires buckets of at least DDP's first bucket (1 MiB): 1 MiB buckets, and a
# model of ~2.7 MB (four 360x360 layers) spanning several of them.
CAP_MB = 1.0
STEPS = 4


class Net(nn.Module):
    """A user-defined forward: dynamo compiles the wrapped module's forward frame, and a frame
    that starts in torch's own code (``nn.Sequential.forward``) is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 360)
        self.hidden = nn.ModuleList(nn.Linear(360, 360) for _ in range(4))
        self.out = nn.Linear(360, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(RANK)  # different data on every rank
    return [(torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)) for _ in "abcd"]


def train(make_hook, make_opt, compiled: bool) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    hook = make_hook()
    if hook is not None:
        comm.register(ddp, hook)
    opt = make_opt(model)
    graphs = []

    def count(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    run = torch.compile(ddp, backend=count) if compiled else ddp
    grads = []
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(run(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return grads, params, len(graphs)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def dgcsgd(m: nn.Module) -> torch.optim.Optimizer:
    return comm.DGCSGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)


HOOKS = {
    "none": (lambda: None, sgd),
    "allreduce": (comm.allreduce, sgd),
    "fp16": (lambda: comm.fp16_compress(scale=10), sgd),
    "bf16": (comm.bf16_compress, sgd),
    "hierarchical": (comm.hierarchical, sgd),
    "hier_fp16_outer": (lambda: comm.hierarchical(outer=comm.fp16_compress(scale=10)), sgd),
    "multi_stream_fp16": (lambda: comm.multi_stream(comm.fp16_compress(), streams=2), sgd),
    # rank >= min(n, m): P Q^T reconstructs each matrix exactly, whatever the random Q
    "powersgd_full": (
        lambda: comm.powersgd(rank=360, start_iter=2, min_compression_rate=0),
        sgd,
    ),
    "nan_hier_powersgd_full": (
        lambda: comm.nan_check(
            comm.hierarchical(outer=comm.powersgd(rank=360, start_iter=2, min_compression_rate=0))
        ),
        sgd,
    ),
    # rank 1: lossy; its random Q depends on the bucket's layout (see the pytest side)
    "powersgd_r1": (lambda: comm.powersgd(rank=1, start_iter=2, min_compression_rate=0), sgd),
    # every element sampled: the exact top-k per tensor, whatever the bucket layout
    "dgc_full_sample": (lambda: comm.dgc(compress_ratio=0.05, sample_ratio=1.0), dgcsgd),
    # sampled from a random start drawn per bucket (see the pytest side)
    "dgc": (lambda: comm.dgc(compress_ratio=0.05), dgcsgd),
}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    results: dict = {"errors": {}}
    exact: list[torch.Tensor] = []
    try:
        for name, (make_hook, make_opt) in HOOKS.items():
            try:
                eager_g, eager_p, _ = train(make_hook, make_opt, compiled=False)
                torch._dynamo.reset()
                comp_g, comp_p, graphs = train(make_hook, make_opt, compiled=True)
                if name == "none":
                    exact = eager_g
                results[name] = {
                    "grads": [rel(c, e) for c, e in zip(comp_g, eager_g)],
                    "params": rel(comp_p, eager_p),
                    "graphs": graphs,
                    # each run's distance from DDP without a hook on the same params (the
                    # steps before the first compressed one keep the params equal)
                    "vs_exact_eager": [rel(e, x) for e, x in zip(eager_g, exact)],
                    "vs_exact_compiled": [rel(c, x) for c, x in zip(comp_g, exact)],
                }
            except Exception as exc:  # recorded; the pytest side fails with it
                where = "".join(traceback.format_exception(exc)[-4:])
                results["errors"][name] = f"{type(exc).__name__}: {exc}\n{where}"
    finally:
        (out / f"rank{RANK}.json").write_text(json.dumps(results))
    comm.exit_rank(0)


if __name__ == "__main__":
    main()
