"""One rank of the multi-rank comm tests (run by _launch.spawn; not collected by pytest).

Every check trains the same small model with a hook and without one (DDP's own allreduce) in
this process group and records numbers; the pytest side asserts on them.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import pickle
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiak import comm

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
CAP_MB = 0.002  # ~520 floats per bucket: several buckets, odd lengths (uneven shards)


def make_model(sizes: tuple[int, ...] = (13, 36, 29, 5)) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batches(steps: int, n_in: int = 13, n_out: int = 5, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(1000 * seed + RANK)  # different data on every rank
    w = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(seed)) / n_in**0.5
    out = []
    for _ in range(steps):
        x = torch.randn(16, n_in, generator=g)
        out.append((x, x @ w + 0.01 * torch.randn(16, n_out, generator=g)))
    return out


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def train(
    hook,
    data,
    model=None,
    state=None,
    start=0,
    lr=0.1,
    grads_at=(),
    rebuild=False,
    offload=None,
    bucket_view=False,
):
    model = make_model() if model is None else model
    ddp = DDP(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=bucket_view)
    if rebuild:  # let DDP rebuild its buckets first (its 2nd forward) so indices match a restore
        for x, y in data[:2]:
            nn.functional.mse_loss(ddp(x), y).backward()
        model.zero_grad()
    if hook is not None:
        comm.register(ddp, hook, state=state, offload=offload)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, losses = {}, []
    for step in range(start, len(data)):
        x, y = data[step]
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if step in grads_at:
            # A cast hook may hand DDP its fp16/bf16 wire; DDP's copy casts it back.
            assert all(p.grad.dtype == p.dtype for p in model.parameters())
            grads[step] = flat_grads(model).clone()
        opt.step()
        losses.append(loss.item())
    return model, grads, losses


def check_parity(results: dict) -> None:
    """Each hook vs DDP without a hook: grads at steps 0 and 3, params after 6 steps."""
    data = batches(6)
    ref_model, ref_g, _ = train(None, data, grads_at=(0, 3))
    full = dict(rank=64, min_compression_rate=0, start_iter=2)  # rank >= min(n, m): exact
    hooks = {
        "allreduce": lambda: comm.allreduce(),
        "hierarchical": lambda: comm.hierarchical(),
        "fp16": lambda: comm.fp16_compress(scale=10),
        # scale 1: the averaged fp16 wire itself goes back to DDP (no decode pass)
        "fp16_scale1": lambda: comm.fp16_compress(),
        "bf16": lambda: comm.bf16_compress(),
        "multi_stream": lambda: comm.multi_stream(comm.allreduce(), streams=3),
        "hier_fp16_outer": lambda: comm.hierarchical(outer=comm.fp16_compress(scale=10)),
        "fp16_hier": lambda: comm.fp16_compress(comm.hierarchical(), scale=10),
        "hier_fp16_inner": lambda: comm.hierarchical(inner=comm.fp16_compress(scale=10)),
        "hier_ms_fp16": lambda: comm.hierarchical(
            outer=comm.multi_stream(comm.fp16_compress(scale=10), streams=2)
        ),
        "powersgd_full": lambda: comm.powersgd(**full),
        "hier_powersgd_full": lambda: comm.hierarchical(outer=comm.powersgd(**full)),
        "nan_hier_powersgd_full": lambda: comm.nan_check(
            comm.hierarchical(outer=comm.powersgd(**full))
        ),
    }
    # The same trees on aiak's worker thread (the default for CUDA buckets, forced here on
    # gloo): same results, collectives in the same order on every rank.
    for name in ("allreduce", "fp16", "fp16_scale1", "hier_fp16_outer", "nan_hier_powersgd_full"):
        hooks[f"{name}+offload"] = hooks[name]
    # Buckets coalesced into fewer collective calls (the last call of a step is partial).
    hooks["nan_fp16"] = lambda: comm.nan_check(comm.fp16_compress(scale=10))
    coalesced = {
        "allreduce+coalesce2": ("allreduce", 2),
        "fp16+coalesce3": ("fp16", 3),
        "fp16_scale1+coalesce3": ("fp16_scale1", 3),  # held buckets settle with the wire
        "multi_stream+coalesce2": ("multi_stream", 2),
        "nan_fp16+coalesce2+offload": ("nan_fp16", 2),
        "hier_fp16_outer+coalesce2": ("hier_fp16_outer", 2),  # ignored, with a warning
    }
    for name, (base, k) in coalesced.items():
        hooks[name] = _with_coalesce(hooks[base], k)
    # DDP with gradients as views of its buckets: the results are copied (and cast) there too.
    for name in ("fp16_scale1", "fp16", "bf16"):
        hooks[f"{name}+view"] = hooks[name]
    for name, make in hooks.items():
        offload = True if name.endswith("+offload") else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, g, _ = train(
                make(),
                data,
                grads_at=(0, 3),
                offload=offload,
                bucket_view=name.endswith("+view"),
            )
        if name.startswith("hier_fp16_outer+coalesce"):
            results["coalesce_ignored_warning"] = [str(w.message) for w in caught]
        results[name] = {
            "grad0": rel(g[0], ref_g[0]),
            "grad3": rel(g[3], ref_g[3]),
            "params": rel(flat_params(model), flat_params(ref_model)),
        }


def _with_coalesce(make, k: int):
    def build():
        hook = make()
        hook.state.coalesce = k
        return hook

    return build


def bucket_lengths() -> list[int]:
    """DDP's bucket lengths after its rebuild at step 1 (recorded by a plain torch hook)."""
    seen: dict[int, int] = {}

    def record(state, bucket):
        seen[bucket.index()] = bucket.buffer().numel()
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = DDP(make_model(), bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, record)
    for x, y in batches(2):
        nn.functional.mse_loss(ddp(x), y).backward()
    return [seen[i] for i in sorted(seen)]


def check_bytes(results: dict) -> None:
    results["bucket_lengths"] = bucket_lengths()
    for name, make in {
        "allreduce": comm.allreduce,
        "hierarchical": comm.hierarchical,
        "hier_fp16_outer": lambda: comm.hierarchical(outer=comm.fp16_compress(scale=10)),
        "powersgd_r1": lambda: comm.powersgd(rank=1, start_iter=2, min_compression_rate=0),
    }.items():
        hook = make()
        train(hook, batches(3))
        results["bytes_" + name] = hook.state.bytes_sent()


def check_powersgd_convergence(results: dict) -> None:
    sizes = (32, 16)  # linear regression: every run can reach the noise floor
    data = batches(120, 32, 16, seed=1)
    losses = {}
    for name, hook in {
        "none": None,
        "powersgd_r1": comm.powersgd(rank=1, start_iter=10),
        "nan_hier_powersgd_r2": comm.nan_check(
            comm.hierarchical(outer=comm.powersgd(rank=2, start_iter=10))
        ),
        "powersgd_r1_no_ef": comm.powersgd(rank=1, start_iter=10, error_feedback=False),
    }.items():
        _, _, loss = train(hook, data, model=make_model(sizes), lr=0.05)
        losses[name] = sum(loss[-10:]) / 10
    results["converge"] = losses


def check_pickle(results: dict) -> None:
    """Pickle a state mid-training, restore it on a fresh DDP: the run continues identically."""
    data = batches(7)

    def make():
        return comm.nan_check(comm.hierarchical(outer=comm.powersgd(rank=2, start_iter=2)))

    hook = make()
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    comm.register(ddp, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blob = snapshot = None
    for step, (x, y) in enumerate(data):
        if step == 4:
            blob = pickle.dumps(hook.state)
            snapshot = copy.deepcopy(model)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    state = pickle.loads(blob)
    inner = state.inner
    results["pickle_groups_dropped"] = inner._intra is None and inner.process_group is None
    results["pickle_error_buckets"] = len(inner.outer.error)
    resumed, _, _ = train(make(), data, model=snapshot, state=state, start=4, rebuild=True)
    results["pickle_resume"] = rel(flat_params(resumed), flat_params(model))


def check_nan(results: dict) -> None:
    data = batches(1)
    x, y = data[0]
    # raise: NaN input on every rank -> every rank raises before sending anything
    ddp = DDP(make_model(), bucket_cap_mb=CAP_MB)
    comm.register(ddp, comm.nan_check(comm.hierarchical()))
    try:
        nn.functional.mse_loss(ddp(x * float("nan")), y).backward()
        results["nan_raise"] = "no error"
    except Exception as exc:
        results["nan_raise"] = f"{type(exc).__name__}: {exc}"
    # raise on the worker thread: the error reaches backward() through DDP's future
    ddp = DDP(make_model(), bucket_cap_mb=CAP_MB)
    comm.register(ddp, comm.nan_check(comm.hierarchical()), offload=True)
    try:
        nn.functional.mse_loss(ddp(x * float("nan")), y).backward()
        results["nan_raise_offload"] = "no error"
    except Exception as exc:
        results["nan_raise_offload"] = f"{type(exc).__name__}: {exc}"
    # skip: only rank 1 has an inf; its share becomes zero, the others' grads are averaged
    model = make_model()
    local = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    hook = comm.nan_check(comm.allreduce(), action="skip")
    comm.register(ddp, hook)
    bad = x.clone()
    if RANK == 1:
        bad[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nn.functional.mse_loss(ddp(bad), y).backward()
    nn.functional.mse_loss(local(bad), y).backward()
    expected = flat_grads(local)
    expected = torch.where(torch.isfinite(expected), expected, torch.zeros(()))
    if RANK == 1:  # every non-finite parameter gradient is zeroed as a whole
        for p in local.parameters():
            if not torch.isfinite(p.grad).all():
                p.grad.zero_()
        expected = flat_grads(local)
    dist.all_reduce(expected)
    results["nan_skip_err"] = rel(flat_grads(model), expected / WORLD)
    results["nan_skip_count"] = hook.state.skipped
    results["nan_skip_warned"] = [str(w.message) for w in caught if "nan_check" in str(w.message)]


def check_accumulate(results: dict) -> None:
    """2 micro-steps of 8 under accumulate == 1 step of 16 (loss halved per micro-step)."""
    x, y = batches(1)[0]
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    hook = comm.allreduce()
    comm.register(ddp, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = comm.accumulate(ddp, 2)
    stepped = []
    for i in range(2):
        with acc:
            (nn.functional.mse_loss(ddp(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]) / 2).backward()
        stepped.append(acc.step(opt))
    ref = make_model()
    ref_ddp = DDP(ref, bucket_cap_mb=CAP_MB)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref_ddp(x), y).backward()
    ref_opt.step()
    results["acc_err"] = rel(flat_params(model), flat_params(ref))
    results["acc_stepped"] = stepped
    results["acc_hook_steps"] = hook.state.step  # hook ran on the synced micro-step only


def suite_main(results: dict) -> None:
    topo = comm.topology()
    results["topology"] = [list(n) for n in topo.nodes]
    for check in (
        check_parity,
        check_bytes,
        check_pickle,
        check_nan,
        check_accumulate,
        check_powersgd_convergence,
    ):
        t = time.perf_counter()
        try:
            check(results)
        except Exception as exc:  # recorded; the pytest side fails with it
            # The last frames say where: enough to debug from the pytest report alone.
            where = "".join(traceback.format_exception(exc)[-4:])
            msg = f"{type(exc).__name__}: {exc}\n{where}"
            results.setdefault("errors", {})[check.__name__] = msg
        results.setdefault("seconds", {})[check.__name__] = round(time.perf_counter() - t, 2)


def suite_kill(results: dict) -> None:
    """Rank 3 dies at step 3; the survivors must raise, naming a rank, within the timeout."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    comm.register(ddp, comm.hierarchical(outer=comm.fp16_compress()))
    t0 = None
    try:
        for step, (x, y) in enumerate(batches(50)):
            if step == 3:
                if RANK == 3:
                    os._exit(17)
                t0 = time.monotonic()
            nn.functional.mse_loss(ddp(x), y).backward()
        results["kill"] = "finished without error"
    except Exception as exc:
        results["kill"] = f"{type(exc).__name__}: {exc}"
    results["kill_seconds"] = None if t0 is None else time.monotonic() - t0


def main() -> None:
    suite, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    results: dict = {}
    try:
        {"main": suite_main, "kill": suite_kill}[suite](results)
    finally:
        (out / f"rank{RANK}.json").write_text(json.dumps(results))
    if suite == "kill":
        # The group is broken: a barrier or destroy could block on the dead peer.
        os._exit(0)
    comm.exit_rank(0)


if __name__ == "__main__":
    main()
