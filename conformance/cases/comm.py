"""Conformance of aiak.comm hooks: one DDP step on 4 gloo CPU ranks (2 "nodes" x 2).

Reference: the average of the 4 ranks' gradients computed in float64 in this process, no
communication at all. Candidate: DDP (float32) with the hook, in a spawned process group;
rank 0's averaged gradients are compared. One spec per gradient dtype runs every hook of that
dtype in one spawn: starting 4 processes costs ~20 s on 2 cores, the hooks themselves little.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiak import comm
from aiak.conformance.harness import Case, Spec, register
from aiak.conformance.ranks import free_port, run_ranks

WORLD, PER_NODE, CAP_MB = 4, 2, 0.002  # small buckets: several, with odd lengths
_EXACT_PSGD = dict(
    rank=64, min_compression_rate=0, start_iter=0, error_feedback=False, warm_start=False
)  # rank >= min(n, m): P Q^T == M

HOOKS: dict[str, tuple[Any, torch.dtype]] = {
    "allreduce": (lambda: comm.allreduce(), torch.float32),
    "hierarchical": (lambda: comm.hierarchical(), torch.float32),
    "multi_stream": (lambda: comm.multi_stream(comm.allreduce(), streams=2), torch.float32),
    "fp16_scale10": (lambda: comm.fp16_compress(scale=10), torch.float16),
    # scale 1: the hook hands DDP the averaged fp16 wire; DDP's copy into the grads casts it
    "fp16": (lambda: comm.fp16_compress(), torch.float16),
    "bf16": (lambda: comm.bf16_compress(), torch.bfloat16),
    "hierarchical_outer_fp16": (
        lambda: comm.hierarchical(outer=comm.fp16_compress(scale=10)),
        torch.float16,
    ),
    "fp16_over_hierarchical": (
        lambda: comm.fp16_compress(comm.hierarchical(), scale=10),
        torch.float16,
    ),
    "powersgd_full_rank": (lambda: comm.powersgd(**_EXACT_PSGD), torch.float32),
    "nan_check_hierarchical_powersgd": (
        lambda: comm.nan_check(comm.hierarchical(outer=comm.powersgd(**_EXACT_PSGD))),
        torch.float32,
    ),
    # DGC's dense path (ratio 1, no momentum) and downsampling with n=1: the plain mean
    "dgc_ratio1_momentum0": (lambda: comm.dgc(compress_ratio=1.0, momentum=0.0), torch.float32),
    "downsample_n1": (lambda: comm.downsample(n=1), torch.float32),
}


def _dgc_from_env() -> comm.CommHook:
    """DGC as ``aiakrun --dgc --compress-ratio 1`` builds it, linked to an SGD without
    momentum (what activation does with the script's SGD)."""
    hook = comm.from_env({"AIAK_DGC": "1", "AIAK_DGC_COMPRESS_RATIO": "1"})
    comm.link_dgc_optimizer(hook, comm.DGCSGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    return hook


HOOKS["dgc_from_env_ratio1"] = (_dgc_from_env, torch.float32)
# The same trees run on aiak's worker thread instead of DDP's autograd thread (the default for
# CUDA gradients; forced here on gloo): identical collectives, in the same order.
for _name in ("allreduce", "fp16_scale10", "nan_check_hierarchical_powersgd"):
    HOOKS[f"{_name}+offload"] = HOOKS[_name]
# Consecutive buckets' allreduces issued as one coalesced collective call (k per call).
HOOKS["allreduce+coalesce2"] = HOOKS["allreduce"]
HOOKS["fp16_scale10+coalesce3"] = HOOKS["fp16_scale10"]
# DDP with gradients as views of its buckets (results are copied, and cast, there as well).
HOOKS["fp16+view"] = HOOKS["fp16"]


def _register(ddp: nn.parallel.DistributedDataParallel, label: str) -> None:
    options = label.split("+")[1:]
    coalesce = next((int(o[8:]) for o in options if o.startswith("coalesce")), None)
    offload = True if "offload" in options else None
    comm.register(ddp, HOOKS[label][0](), offload=offload, coalesce=coalesce)


def _model(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(13, 36), nn.Tanh(), nn.Linear(36, 29), nn.Tanh(), nn.Linear(29, 5)
    ).to(dtype)


def _batch(seed: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(16, 13, generator=g).to(dtype), torch.randn(16, 5, generator=g).to(dtype)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rank_main(rank: int, label: str, seed: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        GROUP_RANK=str(rank // PER_NODE),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    grads = {}
    for hook in label.split(","):
        model = _model(seed, torch.float32)
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view="view" in hook.split("+")
        )
        _register(ddp, hook)
        x, y = _batch(seed, rank, torch.float32)
        nn.functional.mse_loss(ddp(x), y).backward()
        wrong = [n for n, p in model.named_parameters() if p.grad.dtype != p.dtype]
        if wrong:  # a cast hook's wire must come back cast (DDP's copy), never as the grad
            raise TypeError(f"{hook}: gradients of {wrong} are not {torch.float32}")
        grads.update({f"{hook}/{k}": v for k, v in _grads(model).items()})
    if rank == 0:
        torch.save(grads, out)
    del model, ddp
    comm.exit_rank(0)  # shutdown (DDP models released before the groups), then a hard exit


def _specs(device: torch.device) -> list[Spec]:
    groups: dict[torch.dtype, list[str]] = {}
    for label, (_, dtype) in HOOKS.items():
        groups.setdefault(dtype, []).append(label)
    return [
        Spec(
            f"{str(dtype).removeprefix('torch.')} wire: {', '.join(labels)}",
            dtype=dtype,
            params={"hooks": labels},
        )
        for dtype, labels in groups.items()
    ]


def _make_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    return {"hook": ",".join(spec.params["hooks"]), "seed": seed}


def _reference(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = _model(inputs["seed"], torch.float64)
    for rank in range(WORLD):
        x, y = _batch(inputs["seed"], rank, torch.float64)
        (nn.functional.mse_loss(model(x), y) / WORLD).backward()  # grads accumulate: the mean
    grads = _grads(model)
    return {f"{hook}/{k}": v for hook in inputs["hook"].split(",") for k, v in grads.items()}


_CHILD = (
    "import sys; from aiak.conformance.cases.comm import _rank_main as f; "
    "f(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])"
)


def _candidate(inputs: dict[str, Any], limit: float = 300.0) -> dict[str, torch.Tensor]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "grads.pt")
        args = [inputs["hook"], str(inputs["seed"]), str(port), out]
        run_ranks(
            lambda r: [sys.executable, "-c", _CHILD, str(r), *args],
            WORLD,
            limit=limit,
            log_dir=tmp,
            what=f"comm case {inputs['hook']}",
        )
        return torch.load(out)


register(
    Case(
        name="comm.ddp_hooks",
        specs=_specs,
        make_inputs=_make_inputs,
        reference=_reference,
        candidate=_candidate,
        devices=("cpu",),
        description="one DDP step with each aiak.comm hook/composition on 4 gloo ranks vs the "
        "float64 mean of the ranks' gradients",
    )
)
