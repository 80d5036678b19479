"""Kernel time of a timm Swin-T training step per mode, compiled and eager (research).

    python research/profile_swin_compiled_kernels.py

Modes: plain timm; ``swin.convert`` (attention and the gather partition ops);
``convert-attn`` (attention fused, timm's roll + partition). Batch 64, fp16 autocast,
GradScaler, torch fused AdamW. Per mode: step time from CUDA events (15 steps, 3 rounds), the
profiler's kernel time per step and its top kernels. Findings: swin_compiled_kernels.md.
"""

from __future__ import annotations

import collections
import statistics
import time

import timm
import torch
from torch.profiler import ProfilerActivity, profile

import aiak.ops.swin as swin

B = 64


def build(mode: str, compiled: bool, x: torch.Tensor, y: torch.Tensor):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224").cuda()
    if mode in ("convert", "convert-attn"):
        swin.convert(model)
    if mode == "convert-attn":  # the blocks back on timm's roll + partition
        for block in model.modules():
            if hasattr(block, "_aiak_timm_attn"):
                block._attn = block._aiak_timm_attn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    run = torch.compile(model) if compiled else model

    def step() -> None:
        with torch.autocast("cuda", torch.float16):
            loss = torch.nn.functional.cross_entropy(run(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def measure(name: str, step) -> None:
    t0 = time.time()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm = time.time() - t0
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(15):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 15)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total / 5
            count[ev.name] += 1
    print(
        f"\n=== {name}: step {statistics.median(times):.2f} ms "
        f"(rounds {[round(t, 2) for t in times]}), kernel time/step "
        f"{sum(total.values()) / 1000:.2f} ms, kernels/step {sum(count.values()) // 5}, "
        f"warm-up {warm:.0f} s",
        flush=True,
    )
    for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:22]:
        print(f"  {v / 1000:7.3f} ms  x{count[k] // 5:3d}  {k[:110]}")


def main() -> None:
    torch.backends.cudnn.benchmark = True
    x = torch.randn(B, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (B,), device="cuda")
    for compiled in (True, False):
        for mode in ("convert", "plain", "convert-attn"):
            if not compiled and mode == "convert-attn":
                continue
            name = f"{mode}{' + compile' if compiled else ''}"
            measure(name, build(mode, compiled, x, y))


if __name__ == "__main__":
    main()
