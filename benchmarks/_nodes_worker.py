"""The training script ``bench_comm_nodes.py`` starts with ``aiakrun``: torch only, no aiak call
(but ``--optimizer fused-sgd``, which builds aiak.optim.FusedSGD as a user would).

aiakrun's flags switch the hook on (activation registers it when DDP is built); this script
trains as it would without them. Per model it measures, on every rank:

* the averaged gradient of one step against the no-hook result computed here without DDP
  (local backward on a copy, ``all_reduce`` / world: what DDP's own allreduce returns), and
  against torch's fp16 hook's result on the same gradients (the bound for fp16 wires);
* the step time (synchronised; a step ends when the slowest rank ends);
* the optimizer's step alone (``opt_ms``, synchronised; not where the overlap steps it inside
  the backward);
* the host time of the ``backward()`` call (``bwd_host_ms``: autograd's launches and the hooks'
  host work), and of the same call in the step with no exchange (``local_bwd_host_ms``): when
  the backward's host time is the step's time, the hooks' host work is what a mode adds;
* the bytes sent per step per stage, from the registered hook's counters (``ddp._aiak_hook``,
  read here only for the report), and the bytes that left this node's link device.

Rank 0 writes one JSON row per model to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def build(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    """(model, x, y, batch) with the same weights on every rank and a batch per rank."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None)
        batch = 32
        x = torch.randn(batch, 3, 224, 224, generator=gen)
        y = torch.randint(0, 1000, (batch,), generator=gen)
    else:
        width, layers = {"linear": (4096, 12), "tiny": (64, 3)}[name]
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        batch = 32
        x = torch.randn(batch, width, generator=gen)
        y = torch.randn(batch, width, generator=gen)
    return model.to(device), x.to(device), y.to(device), batch


def loss_of(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "resnet50":
        return nn.functional.cross_entropy(out, y)
    return nn.functional.mse_loss(out, y)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in model.parameters()])


def references(name: str, model: nn.Module, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact mean gradient, torch fp16 hook's mean gradient) at ``model``'s weights."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=False)
    loss_of(name, ref(x), y).backward()
    world = dist.get_world_size()
    exact, half = [], []
    for p in ref.parameters():
        g = p.grad.detach()
        h = g.to(torch.float16).div_(world)  # torch's fp16_compress_hook: cast, divide, sum
        dist.all_reduce(h)
        half.append(h.float().flatten())
        dist.all_reduce(g)
        exact.append(g.div_(world).flatten())
    return torch.cat(exact), torch.cat(half)


def link_bytes(dev: str | None) -> int:
    if not dev:
        return 0
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def trace_steps(step, sync, path: str) -> None:
    """Two more training steps under torch's profiler, host and GPU, each step inside a
    ``step`` range; rank 0 writes the chrome trace to ``path`` (the other ranks run the same
    steps unprofiled, so every collective has its peers)."""
    if dist.get_rank() != 0:
        for _ in range(2):
            step()
            sync()
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            with torch.profiler.record_function("step"):
                step()
                sync()
    prof.export_chrome_trace(path)


def run_model(name: str, args: argparse.Namespace, device: torch.device) -> dict | None:
    model, x, y, batch = build(name, device)
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = getattr(ddp, "_aiak_hook", None)  # what aiakrun's activation registered, if any
    # SGD with momentum: what DGC's launcher mode swaps for its own optimizer.
    if args.optimizer == "fused-sgd":
        from aiak.optim import FusedSGD

        opt = FusedSGD(ddp.parameters(), lr=1e-4, momentum=0.9)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4, momentum=0.9)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    marks: list[float] = []  # host clock after the forward and after the backward's return

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = loss_of(name, ddp(x), y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()

    for _ in range(args.warmup):  # DDP rebuilds its buckets; compressors start at step 2
        step()
    # The checked step: a training step whose gradients are compared with the exact average at
    # the weights it starts from, taken before it (the overlap updates the weights during the
    # backward). In training mode BatchNorm normalises with the batch's statistics, so the copy
    # computes the same local gradients whatever its running buffers hold.
    exact, half = references(name, model, x, y)
    opt.zero_grad(set_to_none=False)
    loss_of(name, ddp(x), y).backward()
    got = flat_grads(model)
    opt.step()
    err = ((got - exact).norm() / exact.norm()).item()
    err_fp16 = ((half - exact).norm() / exact.norm()).item()
    del exact, half, got
    sync()
    dist.barrier()
    sent0 = hook.state.bytes_sent() if hook is not None else None

    def timed(fn, phases: list[float] | None = None) -> list[float]:
        """ms of ``args.steps`` synchronised calls of ``fn``; a training step's backward host
        time (the ``backward()`` call: the hooks' host work included) goes to ``phases``."""
        out = []
        for _ in range(args.steps):
            sync()
            marks.clear()
            t = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t) * 1e3)
            if phases is not None and len(marks) == 2:
                phases.append((marks[1] - marks[0]) * 1e3)
        return out

    def local_step() -> None:
        with ddp.no_sync():
            step()

    tx0 = link_bytes(args.link_dev)
    bwd_host: list[float] = []
    times = timed(step, bwd_host)
    tx1 = link_bytes(args.link_dev)
    sent1 = hook.state.bytes_sent() if hook is not None else None
    opt_ms = local_ms = local_bwd = -1.0
    if args.trace:
        trace_steps(step, sync, f"{args.trace}_{name}_rank{dist.get_rank()}.json.gz")
    # Not for the overlap, whose optimizer step runs inside the exchange: the optimizer step
    # alone, and the same training step with no exchange at all (DDP's no_sync: no hook, no
    # allreduce), the floor under every mode's step (flat / local_ms bounds any mode's gain).
    if os.environ.get("AIAK_OVERLAP_BACKWARD_AND_STEP", "0") != "1":
        opt_ms = statistics.median(timed(opt.step))
        local_phases: list[float] = []
        local_ms = statistics.median(timed(local_step, local_phases))
        local_bwd = statistics.median(local_phases)
    per_rank = torch.tensor(
        [
            (sent1["intra_total"] - sent0["intra_total"]) / args.steps if hook else -1.0,
            (sent1["inter_total"] - sent0["inter_total"]) / args.steps if hook else -1.0,
            (tx1 - tx0) / args.steps,
            opt_ms,
            local_ms,
            statistics.median(bwd_host),
            local_bwd,
        ],
        dtype=torch.float64,
        device=device,
    )
    step_ms = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
    every = [torch.empty_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(every, per_rank)
    if dist.get_rank() != 0:
        return None
    rows = torch.stack(every).cpu()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node_heads = rows[::local]  # one rank per node reads its node's link counter
    return {
        "model": name,
        "batch_per_rank": batch,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "hook": getattr(hook, "__name__", "DDP allreduce") if hook is not None else "DDP",
        "step_ms": statistics.median(step_ms.cpu().tolist()),
        "rel_err": err,
        "rel_err_torch_fp16": err_fp16,
        "intra_bytes_per_step": rows[:, 0].sum().item() if hook is not None else None,
        "inter_bytes_per_step": rows[:, 1].sum().item() if hook is not None else None,
        "link_tx_per_step": node_heads[:, 2].sum().item(),
        "opt_ms": rows[:, 3].max().item() if rows[0, 3] >= 0 else None,
        "local_ms": rows[:, 4].max().item() if rows[0, 4] >= 0 else None,
        "bwd_host_ms": rows[:, 5].max().item(),
        "local_bwd_host_ms": rows[:, 6].max().item() if rows[0, 6] >= 0 else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="linear")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--optimizer", choices=("sgd", "fused-sgd"), default="sgd")
    p.add_argument(
        "--link-dev",
        default=os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME"),
        help="this node's link device (its tx counter); default: the socket interface",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--trace", default="", help="rank 0 writes <trace>_<model>_rank0.json.gz")
    args = p.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rows = [run_model(name, args, device) for name in args.models.split(",")]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
