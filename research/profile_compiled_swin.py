"""The compiled Swin-T training step's kernels, side by side, with and without ``swin.convert``.

    python research/profile_compiled_swin.py [--batch 64] [--steps 5] [--top 25]

timm ``swin_tiny_patch4_window7_224``, fp16 autocast + GradScaler, torch's fused AdamW, the
model under ``torch.compile`` (inductor), one process, one GPU. Variants:

- ``timm``: timm's model as it is (the baseline: inductor's own attention code);
- ``convert``: ``aiak.ops.swin.convert`` as shipped: the fused attention op, timm's roll and
  partition inside the compiled graph (inductor fuses them with LayerNorm / the residual add);
- ``convert_gather``: ``convert`` with the roll+partition / merge+roll gather ops kept inside
  the compiled graph too (the layout before the change; each op is opaque to inductor).

For each: the median step time (CUDA events over ``--steps`` steps after warm-up), then one
profiled step's CUDA kernels grouped by name, the ``--top`` by total time side by side
(count x mean us), and the sums per kernel family (gemm, attention, aiak ops, inductor's
triton kernels, copies, optimizer). Needs a GPU, timm and triton; prints only.
"""

from __future__ import annotations

import argparse
import re
import statistics
import types
from collections import defaultdict

import torch
from torch.nn import functional as F

FAMILIES = (
    ("aiak", re.compile(r"window_attention|window_gather|aiak", re.I)),
    ("attention (sdpa/flash/mem-eff)", re.compile(r"fmha|flash|attention|mem_eff|cutlassF", re.I)),
    ("gemm", re.compile(r"gemm|sm90|sm80|cutlass|cublas|xmma|ampere|hopper", re.I)),
    ("inductor triton", re.compile(r"^triton_")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy / elementwise (aten)", re.compile(r"elementwise|copy|vectorized|unrolled|index", re.I)),
)


def _family(name: str) -> str:
    for fam, pat in FAMILIES:
        if pat.search(name):
            return fam
    return "other"


def _gather_attn(block_attn):
    """The converted block's attention with the gather ops also under compile."""
    from aiak.ops.window_attention import roll_window_partition, window_merge_roll

    def attn(self, x):
        _, h, w, _ = x.shape
        ws = self.window_size[0] if isinstance(self.window_size, tuple) else self.window_size
        shift = self.shift_size[0] if isinstance(self.shift_size, tuple) else self.shift_size
        if h % ws or w % ws:
            return block_attn(self, x)
        windows = roll_window_partition(x, ws, shift)
        windows = self.attn(windows, mask=self.attn_mask)
        return window_merge_roll(windows, h, w, shift)

    return attn


def build(variant: str, batch: int):
    import timm

    from aiak.ops import swin

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224").cuda()
    if variant != "timm":
        swin.convert(model)
    if variant == "convert_gather":
        for m in model.modules():
            if hasattr(m, "_aiak_timm_attn"):
                m._attn = types.MethodType(_gather_attn(swin._fused_block_attn), m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    compiled = torch.compile(model)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(compiled(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def measure(step, steps: int) -> tuple[float, dict[str, tuple[int, float]]]:
    for _ in range(3):  # compile, autotune, allocator
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time)
    return statistics.median(times), {k: (len(v), sum(v)) for k, v in kernels.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--variants", default="timm,convert,convert_gather")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  batch {args.batch}")
    results = {}
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        ms, kernels = measure(build(variant, args.batch), args.steps)
        results[variant] = (ms, kernels)
        print(f"{variant:15s} step {ms:7.2f} ms   kernels {sum(c for c, _ in kernels.values())}")
    names = list(results)
    print("\nper family, us per step:")
    print(f"{'family':32s}" + "".join(f"{n:>18s}" for n in names))
    fams = sorted({_family(k) for _, ks in results.values() for k in ks})
    for fam in fams:
        row = [sum(t for k, (_, t) in results[n][1].items() if _family(k) == fam) for n in names]
        print(f"{fam:32s}" + "".join(f"{v:18.0f}" for v in row))
    for n in names:
        ms, kernels = results[n]
        print(f"\n{n}: top {args.top} kernels (count x mean us = total us)")
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.top]
        for name, (count, total) in top:
            print(
                f"  {total:9.0f}  {count:4d} x {total / count:7.1f}  [{_family(name)}] {name[:90]}"
            )


if __name__ == "__main__":
    main()
