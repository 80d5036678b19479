"""One rank of the DGC / downsampling / overlap_step tests (run by _launch.spawn with this file
as the worker; not collected by pytest). Records numbers; test_dgc_multirank.py asserts."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiak import comm

sys.path.insert(0, str(Path(__file__).parent))
from _dgc_ref import sparsify_f64

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CAP_MB = 0.02  # a few buckets mixing weights and biases


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 6)
    )


def batches(steps: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(1000 * seed + RANK)
    return [
        (torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)) for _ in range(steps)
    ]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_sparse_selection(results: dict) -> None:
    """Step 0, momentum 0: the averaged result == mean over ranks of each rank's selection by a
    float64 reference of the algorithm (samples = every element, so no random start)."""
    ratio = 0.05
    model = make_model()
    local = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    hook = comm.dgc(compress_ratio=ratio, sample_ratio=1.0, momentum=0.0)
    comm.register(ddp, hook)
    x, y = batches(1)[0]
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(local(x), y).backward()
    errs, dense_errs, nnz = [], [], []
    for (_name, p), q in zip(model.named_parameters(), local.parameters()):
        mine = q.grad.detach().reshape(-1).contiguous()
        every = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        if p.dim() > 1:
            n = mine.numel()
            exp = np.zeros(n)
            for g in every:
                # every element sampled: no adaptation, the k largest
                idx = sparsify_f64(g.numpy(), ratio, 1.0, np.arange(n), 1.3, 0.8, 10, True)
                idx = idx[idx >= 0]
                exp[idx] += g.numpy()[idx]
            exp /= WORLD
            got = p.grad.detach().reshape(-1).double().numpy()
            errs.append(float(np.abs(got - exp).max()))
            nnz.append(int((got != 0).sum()))
        else:
            mean = torch.stack(every).double().mean(0)
            dense_errs.append(rel(p.grad.reshape(-1), mean))
    results["sel_max_abs_err"] = max(errs)
    results["sel_dense_err"] = max(dense_errs)
    results["sel_nnz"] = nnz
    results["sel_k"] = [
        max(1, math.ceil(p.numel() * ratio)) for p in model.parameters() if p.dim() > 1
    ]
    lengths = [max(1, math.ceil(p.numel() * ratio)) for p in model.parameters() if p.dim() > 1]
    results["bytes_dgc"] = hook.state.bytes_sent()
    # fp16_values: the values AND the dense tensors' allreduce travel in fp16
    half = comm.dgc(compress_ratio=ratio, sample_ratio=1.0, momentum=0.0, fp16_values=True)
    ddp16 = DDP(copy.deepcopy(local), bucket_cap_mb=CAP_MB)
    comm.register(ddp16, half)
    nn.functional.mse_loss(ddp16(x), y).backward()
    results["bytes_dgc_fp16"] = half.state.bytes_sent()
    results["bytes_dgc_formula"] = {
        "sparse_pairs": sum(lengths),
        "dense_elems": sum(p.numel() for p in model.parameters() if p.dim() <= 1),
    }


def train(hook, data, opt_fn, model=None, state=None, start=0, overlap=False, rebuild=False):
    model = make_model() if model is None else model
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    if rebuild:
        for x, y in data[:2]:
            nn.functional.mse_loss(ddp(x), y).backward()
        model.zero_grad()
    opt = opt_fn(model)
    stepper = None
    if overlap:
        stepper = comm.overlap_step(ddp, opt, hook=hook, offload=overlap == "offload")
    elif hook is not None:
        comm.register(ddp, hook, state=state)
    for step in range(start, len(data)):
        x, y = data[step]
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if stepper is None:
            opt.step()
    return model, stepper


def sgd(momentum=0.0, wd=0.0):
    return lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)


def dgcsgd(momentum=0.9, wd=1e-2):
    return lambda m: comm.DGCSGD(m.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)


def check_dense_equivalence(results: dict) -> None:
    """ratio 1 without masking: DGC's memory momentum + DGCSGD == torch SGD(momentum, wd)."""
    data = batches(6)
    ref, _ = train(None, data, sgd(0.9, 1e-2))
    for nesterov in (False, True):
        ref_n, _ = train(
            None,
            data,
            lambda m, n=nesterov: torch.optim.SGD(
                m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=n
            ),
        )
        got, _ = train(
            comm.dgc(compress_ratio=1.0, momentum_masking=False, nesterov=nesterov),
            data,
            lambda m, n=nesterov: comm.DGCSGD(
                m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=n
            ),
        )
        results[f"dense_equiv_nesterov{int(nesterov)}"] = rel(flat_params(got), flat_params(ref_n))
    results["dense_equiv_ref_sane"] = rel(flat_params(ref), flat_params(make_model()))


def check_overlap(results: dict) -> None:
    """overlap_step gives the parameters of the plain loop (same hook, same optimizer)."""
    data = batches(5)
    cases = {
        "allreduce": (lambda: comm.allreduce(), sgd(0.9, 1e-3)),
        "fp16": (lambda: comm.fp16_compress(), sgd(0.9)),
        "fp16_scale10": (lambda: comm.fp16_compress(scale=10), sgd()),
        "dgc": (lambda: comm.dgc(compress_ratio=0.05), dgcsgd()),
        "downsample": (lambda: comm.downsample(n=3), sgd()),
        "adam": (lambda: comm.allreduce(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)),
    }
    for name, (make, opt) in cases.items():
        plain, _ = train(make(), data, opt)
        over, stepper = train(make(), data, opt, overlap=True)
        results[f"overlap_{name}"] = rel(flat_params(over), flat_params(plain))
        results[f"overlap_{name}_steps"] = stepper.steps
    # the steps on aiak's worker thread (the default for CUDA models)
    plain, _ = train(comm.allreduce(), data, sgd(0.9, 1e-3))
    over, stepper = train(comm.allreduce(), data, sgd(0.9, 1e-3), overlap="offload")
    results["overlap_offload"] = rel(flat_params(over), flat_params(plain))
    results["overlap_offload_steps"] = stepper.steps

    # global-norm clipping: every bucket first, then one step over all parameters
    def clip_loop():
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        comm.register(ddp, comm.allreduce())
        opt = sgd(0.9)(model)
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        return model

    plain = clip_loop()
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    opt = sgd(0.9)(model)
    stepper = comm.overlap_step(ddp, opt, "norm", {"max_norm": 0.05})
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
    results["overlap_clip_norm"] = rel(flat_params(model), flat_params(plain))
    results["overlap_clip_steps"] = stepper.steps


def check_errors(results: dict) -> None:
    errors = {}
    for name, opt_fn, hook in (
        ("adam_dgc", lambda m: torch.optim.Adam(m.parameters()), comm.dgc()),
        ("sgd_momentum_dgc", sgd(0.9), comm.dgc()),
    ):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        try:
            comm.overlap_step(ddp, opt_fn(model), hook=hook)
            errors[name] = "no error"
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    try:
        comm.DGCSGD.from_optimizer(torch.optim.AdamW(make_model().parameters()))
        errors["from_adamw"] = "no error"
    except Exception as exc:
        errors["from_adamw"] = f"{type(exc).__name__}: {exc}"
    opt = comm.DGCSGD.from_optimizer(
        torch.optim.SGD(make_model().parameters(), lr=0.3, momentum=0.8, weight_decay=0.1)
    )
    errors["from_sgd"] = [opt.param_groups[0][k] for k in ("lr", "momentum", "weight_decay")]
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    comm.register(ddp, comm.allreduce())
    try:
        comm.overlap_step(ddp, sgd()(model))
        errors["registered_twice"] = "no error"
    except Exception as exc:
        errors["registered_twice"] = f"{type(exc).__name__}: {exc}"
    results["errors_seen"] = errors


def check_clipping(results: dict) -> None:
    """Local clipping per tensor before compression (ratio 1, momentum 0: the clipped mean)."""
    x, y = batches(1)[0]
    for kind, params in (("value", {"clip_value": 1e-3}), ("norm", {"max_norm": 1e-2})):
        model = make_model()
        local = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        comm.register(
            ddp,
            comm.dgc(
                compress_ratio=1.0, momentum=0.0, clip_grad_func=kind, clip_grad_func_params=params
            ),
        )
        (nn.functional.mse_loss(ddp(x), y) * 50).backward()
        (nn.functional.mse_loss(local(x), y) * 50).backward()
        errs = []
        for p, q in zip(model.parameters(), local.parameters()):
            g = q.grad.detach().clone()
            if kind == "value":
                g.clamp_(-1e-3, 1e-3)
            else:
                g.mul_(min(1.0, 1e-2 / (float(g.norm()) + 1e-6)))
            dist.all_reduce(g)
            errs.append(rel(p.grad, g / WORLD))
        results[f"clip_{kind}"] = max(errs)


def check_downsample(results: dict) -> None:
    """Same gradient every step (no optimizer): over steps 2n..3n-1 each element arrives once,
    carrying n steps of gradient (momentum 1). (DDP rebuilds its buckets after step 0, which
    moves the chunks once: the first full window after that starts at n.)"""
    n = 3
    model = make_model()
    local = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    hook = comm.downsample(n=n)
    comm.register(ddp, hook)
    x, y = batches(1)[0]
    nn.functional.mse_loss(local(x), y).backward()
    mean = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    dist.all_reduce(mean)
    mean /= WORLD
    got = []
    for _ in range(3 * n):
        model.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        got.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    window = torch.stack(got[2 * n : 3 * n])
    results["ds_each_once"] = bool(((window != 0).sum(0) <= 1).all())
    results["ds_window_err"] = rel(window.sum(0), n * mean)
    results["ds_fraction"] = [float((g != 0).double().mean()) for g in got[2 * n : 3 * n]]
    results["ds_bytes_last"] = hook.state.bytes_sent()["intra"] + hook.state.bytes_sent()["inter"]
    results["ds_params"] = sum(p.numel() for p in model.parameters())


def check_pickle(results: dict) -> None:
    """DGC residuals/momentum and downsampling memory survive pickling: the resumed run
    continues bit for bit."""
    data = batches(8)
    for name, make, opt in (
        ("dgc", lambda: comm.dgc(compress_ratio=0.05), dgcsgd()),
        ("downsample", lambda: comm.downsample(n=3, momentum=0.9), sgd()),
    ):
        hook = make()
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        comm.register(ddp, hook)
        o = opt(model)
        blob = snapshot = opt_state = None
        for step, (x, y) in enumerate(data):
            if step == 5:
                blob = pickle.dumps(hook.state)
                snapshot = copy.deepcopy(model)
                opt_state = copy.deepcopy(o.state_dict())
            o.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            o.step()
        state = pickle.loads(blob)
        # counted before the run: DGC's buckets take their memory out of the loaded dicts
        saved = len(getattr(state, "mmt", None) or state.memory)

        def opt_fn(m, opt=opt, opt_state=opt_state):
            fresh = opt(m)
            fresh.load_state_dict(opt_state)
            return fresh

        resumed, _ = train(make(), data, opt_fn, model=snapshot, state=state, start=5, rebuild=True)
        results[f"pickle_{name}_equal"] = bool(
            torch.equal(flat_params(resumed), flat_params(model))
        )
        results[f"pickle_{name}_memory"] = saved


def main() -> None:
    out = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    results: dict = {}
    try:
        for check in (
            check_sparse_selection,
            check_dense_equivalence,
            check_overlap,
            check_errors,
            check_clipping,
            check_downsample,
            check_pickle,
        ):
            try:
                check(results)
            except Exception as exc:
                where = "".join(traceback.format_exception(exc)[-4:])
                results.setdefault("errors", {})[check.__name__] = f"{exc!r}\n{where}"
    finally:
        (out / f"rank{RANK}.json").write_text(json.dumps(results))
    comm.exit_rank(0)


if __name__ == "__main__":
    main()
