"""ResNet-50's training step, one aiak piece at a time: which piece costs what.

    python research/profile_resnet_step.py [--batch 128] [--steps 10] [--rounds 3] [--top 12]

torchvision ``resnet50`` (channels_last), fp16, the step of ``examples/recipes/_recipe.py``
(zero_grad, next batch, forward + loss under autocast, scaled backward, step, update). Variants,
each built from the same weights and data pool:

- ``o1``: the recipe's baseline (autocast, torch SGD foreach, torch GradScaler, images copied
  and normalised in the step);
- ``o1_fused``: ``o1`` with ``aiak.optim.FusedSGD``;
- ``o2_torch``: ``aiak.amp.decorate`` (O2) with torch SGD foreach, aiak's GradScaler, o1's data;
- ``o2_fused``: O2 + FusedSGD, o1's data;
- ``o2_fused_bn``: ``o2_fused`` with batch norm + (add +) ReLU fused (``aiak.ops.resnet``);
- ``aiak``: the recipe's aiak set-up (``resnet.convert`` + O2 + FusedSGD + CudaPrefetcher +
  GPU normalise).

Per variant: the median step time over ``--rounds`` interleaved rounds of ``--steps`` steps
(host-timed, synchronised), then one profiled step: the GPU kernel time and count, the host
time of the step's phases (``record_function`` ranges), and the synchronising CUDA API calls
(a step that waits for the GPU cannot queue ahead of it). Then the ``--top`` kernels of ``o1``
and ``aiak`` side by side. Needs a GPU and torchvision; prints only.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "recipes"))

PHASES = ("zero_grad", "data", "forward", "backward", "optimizer")
VARIANTS = ("o1", "o1_fused", "o2_torch", "o2_fused", "o2_fused_bn", "aiak")
FAMILIES = (  # first match wins
    (
        "conv (cudnn)",
        re.compile(r"conv|xmma|implicit|dgrad|wgrad|fprop|cudnn|sm90|sm80|cutlass", re.I),
    ),
    ("batch norm", re.compile(r"batch_norm|bn_|batchnorm", re.I)),
    ("optimizer", re.compile(r"sgd|multi_tensor|foreach|fused_", re.I)),
    ("casts / copies", re.compile(r"copy|cast", re.I)),
    ("elementwise (relu, add, ...)", re.compile(r"elementwise|threshold|relu|add", re.I)),
    ("pooling / gemm / loss", re.compile(r"pool|gemm|softmax|nll|reduce", re.I)),
)
SYNC_API = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def build(variant: str, batch: int):
    import resnet50
    import torchvision

    import aiak.amp
    from aiak.optim import FusedSGD

    if variant == "aiak":
        run = resnet50.build(aiak=True, tiny=False, device=torch.device("cuda"), batch=batch)
        return run.step
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    if variant == "o2_fused_bn":
        from aiak.ops import resnet

        resnet.convert(model)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
    fused = variant in ("o1_fused", "o2_fused", "o2_fused_bn")
    opt = (
        FusedSGD(model.parameters(), **kw)
        if fused
        else torch.optim.SGD(model.parameters(), foreach=True, **kw)
    )
    o2 = variant.startswith("o2")
    if o2:
        aiak.amp.decorate(model, opt, dtype=torch.float16)
    scaler = aiak.amp.GradScaler("cuda") if o2 else torch.amp.GradScaler("cuda")
    g = torch.Generator().manual_seed(1)
    pool = [
        (
            torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, generator=g),
            torch.randint(0, 1000, (batch,), generator=g),
        )
        for _ in range(4)
    ]
    pool = [(x.pin_memory(), y.pin_memory()) for x, y in pool]
    cycle = itertools.cycle(pool)
    mean = torch.tensor(resnet50.MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(resnet50.STD, device="cuda").view(1, 3, 1, 1) * 255

    def step():
        with torch.profiler.record_function("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function("data"):
            x, y = next(cycle)
            x = x.cuda(non_blocking=True).float().sub_(mean).div_(std)
            x = x.contiguous(memory_format=torch.channels_last)
            y = y.cuda(non_blocking=True)
        with torch.profiler.record_function("forward"), torch.autocast("cuda", torch.float16):
            loss = F.cross_entropy(model(x), y)
        with torch.profiler.record_function("backward"):
            scaler.scale(loss).backward()
        with torch.profiler.record_function("optimizer"):
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


def timed(step, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def profile(step) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    phases: dict[str, float] = defaultdict(float)
    syncs: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if e.name in PHASES or e.name.startswith("Optimizer."):
                continue  # a user annotation's GPU span, not a kernel
            kernels[e.name].append(e.device_time / 2)
        elif e.name in PHASES:
            phases[e.name] += e.cpu_time_total / 2e3
        elif any(e.name.startswith(s) for s in SYNC_API) and "Async" not in e.name:
            syncs[e.name] += 1
    return {
        "gpu_ms": sum(sum(v) for v in kernels.values()) / 1e3,
        "kernels": sum(len(v) for v in kernels.values()) // 2,
        "phases": dict(phases),
        "syncs": {k: v // 2 for k, v in syncs.items()},
        "by_name": {k: (len(v) // 2, sum(v)) for k, v in kernels.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    names = [v for v in a.variants.split(",") if v]
    steps = {v: build(v, a.batch) for v in names}
    for v in names:  # warm-up: cudnn autotune, allocator, the scalers' first steps
        for _ in range(5):
            steps[v]()
    times: dict[str, list[float]] = defaultdict(list)
    for r in range(a.rounds):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            times[v].append(timed(steps[v], a.steps))
    base = statistics.median(times[names[0]])
    profs = {v: profile(steps[v]) for v in names}
    print(f"{torch.cuda.get_device_name()}, ResNet-50 b{a.batch} fp16 channels_last")
    print(
        f"{'variant':10s} {'step ms':>8s} {'vs ' + names[0]:>7s} {'GPU ms':>7s} {'kernels':>7s}"
        "  host ms per phase / sync calls"
    )
    for v in names:
        t, pr = statistics.median(times[v]), profs[v]
        ph = " ".join(f"{k} {x:.1f}" for k, x in pr["phases"].items())
        sy = " ".join(f"{k} {n}" for k, n in pr["syncs"].items()) or "none"
        print(
            f"{v:10s} {t:8.2f} {base / t:7.3f} {pr['gpu_ms']:7.2f} {pr['kernels']:7d}  {ph} | {sy}"
        )
    print("\nkernel time per step by family (ms):")
    fams = [f for f, _ in FAMILIES] + ["other"]
    print(f"{'family':30s}" + "".join(f"{v:>10s}" for v in names))
    for fam in fams:
        row = []
        for v in names:
            tot = 0.0
            for k, (_n, us) in profs[v]["by_name"].items():
                f = next((f for f, pat in FAMILIES if pat.search(k)), "other")
                tot += us if f == fam else 0.0
            row.append(tot / 1e3)
        print(f"{fam:30s}" + "".join(f"{x:10.2f}" for x in row))
    if "o1" in profs and "aiak" in profs:
        a_k, b_k = profs["o1"]["by_name"], profs["aiak"]["by_name"]
        keys = sorted(
            set(a_k) | set(b_k),
            key=lambda k: -abs(b_k.get(k, (0, 0.0))[1] - a_k.get(k, (0, 0.0))[1]),
        )
        print("\nkernels with the largest difference (us per step): o1 vs aiak, n x")
        for k in keys[: a.top]:
            na, ta = a_k.get(k, (0, 0.0))
            nb, tb = b_k.get(k, (0, 0.0))
            print(f"  {ta:9.1f} ({na:4d}) {tb:9.1f} ({nb:4d})  {k[:110]}")


if __name__ == "__main__":
    main()
