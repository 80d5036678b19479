"""aiak::window_attention vs timm's unfused maths vs SDPA with the bias + mask materialised.

    python benchmarks/bench_window_attention.py [--batches 64,8] [--dtype float16] [--no-e2e]
    python benchmarks/bench_window_attention.py --bwd-variants [--fwd-variants] [--batches 64]

Swin-T's four stages (heads 3/6/12/24, windows per image 64/16/4/1, N = 49, D = 32), shifted
window mask on. Forward and forward + backward, GPU time from CUDA-graph replay (pipelined
time where a path cannot be captured), for both kernel pairs of the op: ``ours_mma``
(tensor-core mma.sync, the default on sm_80+) and ``ours_scalar`` (fp32 FMAs, the fallback),
chosen through ``AIAK_WINDOW_ATTENTION_KERNEL``. "floor us": the bytes of q, k, v and out at
the copy bandwidth measured in this run; "fwd_pct_floor" = floor / ours_mma.

End-to-end rows (timm importable): a swin_tiny_patch4_window7_224 training step, batch 64,
against the plain O1 step (fp16 autocast, GradScaler, torch SGD) in the same run: with
``aiak.ops.swin.convert`` (mma and scalar kernels), with aiak.amp O2 (``aiak.amp.decorate``) +
``aiak.optim.FusedSGD`` alone, and with convert + O2 + FusedSGD stacked. Rows go to
benchmarks/results/window_attention.csv.

``--bwd-variants``: only the sweep of the ``mma`` backward's variants (``BWD_VARIANTS``,
chosen in a run by ``AIAK_WINDOW_ATTENTION_BWD``), side by side in this process at each stage:
the inputs as ``FusedWindowAttention`` hands them over (q/k/v views of one qkv tensor, the
gradient a transposed view), each variant's registers, shared memory, blocks per SM and grid,
backward alone and forward + backward in µs (the median of ``--rounds`` interleaved rounds, each
a CUDA-graph p50), the ratio to ``base``, and the largest absolute difference of each of dq, dk,
dv and dbias from ``base``'s (inf for a NaN). Rows go to
benchmarks/results/window_attention_bwd_variants.csv. ``--fwd-variants``: the same for the
forward's variants (``FWD_VARIANTS``, ``AIAK_WINDOW_ATTENTION_FWD``): forward µs, ratio to
``base``, max |diff| of the output; rows in window_attention_fwd_variants.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from _harness import append_csv, copy_bandwidth, print_table, time_graph, time_pipelined

import aiak.amp as amp
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import swin
from aiak.ops.window_attention import BWD_VARIANTS, FWD_VARIANTS, KERNEL_ENV, window_attention
from aiak.optim import FusedSGD

STAGES = (("stage1", 3, 64), ("stage2", 6, 16), ("stage3", 12, 4), ("stage4", 24, 1))
N, D = 49, 32


def _unfused(q, k, v, bias, mask, scale):
    windows, heads, n, _ = q.shape
    attn = (q * scale) @ k.transpose(-2, -1) + bias.unsqueeze(0)
    nw = mask.shape[0]
    attn = attn.view(windows // nw, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
    return attn.view(windows, heads, n, n).softmax(-1).to(v.dtype) @ v


def _sdpa(q, k, v, bias, mask, scale):
    windows, heads, n, _ = q.shape
    nw = mask.shape[0]
    full = (bias.unsqueeze(0).unsqueeze(0) + mask.unsqueeze(1).unsqueeze(0)).to(q.dtype)
    full = full.expand(windows // nw, nw, heads, n, n).reshape(windows, heads, n, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale)


def _ours(q, k, v, bias, mask, scale):
    return window_attention(q, k, v, bias, mask, scale)


@contextlib.contextmanager
def _kernel(kernel: str | None):
    """Run the op's ``kernel`` pair inside (None: leave the choice as it is)."""
    old = os.environ.get(KERNEL_ENV)
    if kernel is not None:
        os.environ[KERNEL_ENV] = kernel
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = old


def _time(fn) -> float:
    t = time_graph(fn)
    if t is None:
        t = time_pipelined(fn)
    return t[1] * 1e3  # p50 in us


def _measure(fn, args, dout) -> tuple[float, float]:
    """(forward, forward + backward) microseconds of ``fn(*args)``."""
    with torch.no_grad():
        fwd = _time(lambda: fn(*args))
    fwdbwd = _time(lambda: fn(*args).backward(dout))
    for t in args[:4]:
        t.grad = None
    return fwd, fwdbwd


def _kernel_rows(batches, dtype, bw):
    rows = []
    for batch in batches:
        for label, heads, nw in STAGES:
            windows = batch * nw
            q, k, v = (
                torch.randn(windows, heads, N, D, device="cuda", dtype=dtype).requires_grad_()
                for _ in range(3)
            )
            bias = torch.randn(heads, N, N, device="cuda", requires_grad=True)
            mask = torch.where(torch.rand(nw, N, N, device="cuda") < 0.3, -100.0, 0.0)
            dout = torch.randn_like(q)
            scale = D**-0.5
            floor_us = 4 * q.numel() * q.element_size() / bw * 1e6
            row = {"batch": batch, "stage": label, "dtype": str(dtype)[6:], "floor_us": floor_us}
            variants = (
                ("ours_mma", _ours, "mma"),
                ("ours_scalar", _ours, "scalar"),
                ("unfused", _unfused, None),
                ("sdpa", _sdpa, None),
            )
            for name, fn, kernel in variants:
                with _kernel(kernel):
                    fwd, fwdbwd = _measure(fn, (q, k, v, bias, mask, scale), dout)
                row[f"{name}_fwd_us"], row[f"{name}_fwdbwd_us"] = fwd, fwdbwd
            row["fwd_x_sdpa"] = row["sdpa_fwd_us"] / row["ours_mma_fwd_us"]
            row["fwdbwd_x_sdpa"] = row["sdpa_fwdbwd_us"] / row["ours_mma_fwdbwd_us"]
            row["fwdbwd_x_unfused"] = row["unfused_fwdbwd_us"] / row["ours_mma_fwdbwd_us"]
            row["mma_x_scalar"] = row["ours_scalar_fwdbwd_us"] / row["ours_mma_fwdbwd_us"]
            row["fwd_pct_floor"] = 100 * floor_us / row["ours_mma_fwd_us"]
            rows.append(row)
    return rows


def _variant_resources(
    variant: str, dtype, windows: int, heads: int, nw: int, backward: bool = True
) -> dict:
    """Registers (as loaded), dynamic shared memory, blocks per SM and grid of ``variant``."""
    if backward:
        smem = wac._mma_smem_bytes(D, True, BWD_VARIANTS[variant].alias_ps)
    else:
        smem = wac._mma_smem_bytes(D, False)
    _, fn = wac._kernel(f"mma_{'bwd' if backward else 'fwd'}_{variant}", dtype, D, smem)
    device = torch.cuda.current_device()
    smem_sm, regs_sm = wac._sm_limits(device)
    regs = int(fn.num_regs)
    per_sm = min(2048 // wac._THREADS, regs_sm // (-(-regs // 8) * 8 * wac._THREADS))
    per_sm = min(per_sm, smem_sm // (smem + 1024))
    blocks = wac._mma_blocks(fn, windows, heads, nw, smem)
    return {"regs": regs, "smem_B": smem, "blocks_per_sm": per_sm, "grid": f"{blocks}x{heads}"}


def _stage_inputs(batch, heads, nw, dtype, device="cuda"):
    """A stage's module-path inputs: q, k, v as views of one qkv, bias, a 0 / -100 mask."""
    windows = batch * nw
    qkv = torch.randn(windows, N, 3, heads, D, device=device, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(heads, N, N, device=device)
    mask = torch.where(torch.rand(nw, N, N, device=device) < 0.3, -100.0, 0.0)
    return windows, q, k, v, bias, mask


def _bwd_variant_rows(batches, dtype, rounds):
    """The mma backward's variants side by side (module path inputs, launcher calls)."""
    rows = []
    for batch in batches:
        for label, heads, nw in STAGES:
            windows, q, k, v, bias, mask = _stage_inputs(batch, heads, nw, dtype)
            grad = torch.randn(windows, N, heads, D, device="cuda", dtype=dtype).transpose(1, 2)
            scale = D**-0.5

            def fwd(q=q, k=k, v=v, bias=bias, mask=mask, scale=scale):
                return wac._attention_cuda_with("mma", q, k, v, bias, mask, scale, True)

            def bwd(variant, q=q, k=k, v=v, bias=bias, mask=mask, grad=grad, scale=scale):
                return wac._attention_backward_cuda_with(
                    "mma", grad, q, k, v, bias, mask, scale, variant
                )

            base = bwd("base")
            times = {v: ([], []) for v in BWD_VARIANTS}
            for _ in range(rounds):  # interleaved: drift hits every variant alike
                for variant, (alone, both) in times.items():
                    alone.append(_time(lambda variant=variant: bwd(variant)))
                    both.append(_time(lambda variant=variant: (fwd(), bwd(variant))))
            for variant, (alone, both) in times.items():
                row = {"batch": batch, "stage": label, "dtype": str(dtype)[6:], "variant": variant}
                row.update(_variant_resources(variant, dtype, windows, heads, nw))
                row["bwd_us"] = sorted(alone)[len(alone) // 2]
                row["fwdbwd_us"] = sorted(both)[len(both) // 2]
                for name, a, b in zip(("dq", "dk", "dv", "dbias"), bwd(variant), base):
                    diff = (a.float() - b.float()).abs().nan_to_num(nan=float("inf"))
                    row[f"{name}_maxdiff"] = float(diff.max())
                rows.append(row)
            first = rows[-len(BWD_VARIANTS)]
            for row in rows[-len(BWD_VARIANTS) :]:
                row["bwd_x_base"] = first["bwd_us"] / row["bwd_us"]
                row["fwdbwd_x_base"] = first["fwdbwd_us"] / row["fwdbwd_us"]
    return rows


def _fwd_variant_rows(batches, dtype, rounds):
    """The mma forward's variants side by side: µs, ratio and max |diff| of out vs ``base``."""
    rows = []
    for batch in batches:
        for label, heads, nw in STAGES:
            windows, q, k, v, bias, mask = _stage_inputs(batch, heads, nw, dtype)

            def fwd(variant, q=q, k=k, v=v, bias=bias, mask=mask):
                return wac._attention_cuda_with("mma", q, k, v, bias, mask, D**-0.5, True, variant)

            base = fwd("base")
            times = {v: [] for v in FWD_VARIANTS}
            for _ in range(rounds):
                for variant, samples in times.items():
                    samples.append(_time(lambda variant=variant: fwd(variant)))
            for variant, samples in times.items():
                row = {"batch": batch, "stage": label, "dtype": str(dtype)[6:], "variant": variant}
                row.update(_variant_resources(variant, dtype, windows, heads, nw, backward=False))
                row["fwd_us"] = sorted(samples)[len(samples) // 2]
                diff = (fwd(variant).float() - base.float()).abs().nan_to_num(nan=float("inf"))
                row["out_maxdiff"] = float(diff.max())
                rows.append(row)
            first = rows[-len(FWD_VARIANTS)]
            for row in rows[-len(FWD_VARIANTS) :]:
                row["fwd_x_base"] = first["fwd_us"] / row["fwd_us"]
    return rows


E2E_VARIANTS = (  # (label, convert, kernel, O2 + FusedSGD)
    ("timm O1", False, None, False),
    ("timm O1 + convert", True, "mma", False),
    ("timm O1 + convert (scalar kernels)", True, "scalar", False),
    ("timm O2 + FusedSGD", False, None, True),
    ("timm O2 + FusedSGD + convert", True, "mma", True),
)


def _e2e_rows():
    try:
        import timm
    except ImportError:
        print("timm not importable: no end-to-end rows", file=sys.stderr)
        return []
    rows = []
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")
    for variant, convert, kernel, o2 in E2E_VARIANTS:
        torch.manual_seed(0)
        model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).cuda()
        if convert:
            swin.convert(model)
        if o2:
            opt = FusedSGD(model.parameters(), lr=1e-3, momentum=0.9)
            model, opt = amp.decorate(model, opt, dtype=torch.float16)
            scaler = amp.GradScaler("cuda")
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            scaler = torch.amp.GradScaler("cuda")

        def step(model=model, opt=opt, scaler=scaler):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        with _kernel(kernel):
            t = time_pipelined(step, calls=10, reps=5)
        rows.append({"stage": "e2e swin_tiny b64 step", "variant": variant, "ms": t[1]})
        del model, opt, scaler
        torch.cuda.empty_cache()
    for row in rows:
        row["x_vs_timm_O1"] = rows[0]["ms"] / row["ms"]
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,8")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--bwd-variants", action="store_true", help="only the backward sweep")
    parser.add_argument("--fwd-variants", action="store_true", help="only the forward sweep")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.fwd_variants:
        print(torch.cuda.get_device_name())
        rows = _fwd_variant_rows(batches, getattr(torch, args.dtype), args.rounds)
        append_csv("window_attention_fwd_variants", rows)
        cols = ["batch", "stage", "variant", "regs", "smem_B", "blocks_per_sm", "grid"]
        print_table(rows, [*cols, "fwd_us", "fwd_x_base", "out_maxdiff"])
    if args.bwd_variants:
        print(torch.cuda.get_device_name())
        rows = _bwd_variant_rows(batches, getattr(torch, args.dtype), args.rounds)
        append_csv("window_attention_bwd_variants", rows)
        cols = ["batch", "stage", "variant", "regs", "smem_B", "blocks_per_sm", "grid"]
        cols += ["bwd_us", "fwdbwd_us", "bwd_x_base", "fwdbwd_x_base"]
        cols += ["dq_maxdiff", "dk_maxdiff", "dv_maxdiff", "dbias_maxdiff"]
        print_table(rows, cols)
    if args.fwd_variants or args.bwd_variants:
        return 0
    bw = copy_bandwidth() * 1e9
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = _kernel_rows(batches, getattr(torch, args.dtype), bw)
    append_csv("window_attention", [{"copy_TBps": bw / 1e12, **r} for r in rows])
    cols = ["batch", "stage", "floor_us", "ours_mma_fwd_us", "ours_scalar_fwd_us"]
    cols += ["unfused_fwd_us", "sdpa_fwd_us", "ours_mma_fwdbwd_us", "ours_scalar_fwdbwd_us"]
    cols += ["unfused_fwdbwd_us", "sdpa_fwdbwd_us", "fwd_pct_floor", "fwd_x_sdpa"]
    cols += ["fwdbwd_x_sdpa", "fwdbwd_x_unfused", "mma_x_scalar"]
    print_table(rows, cols)
    if not args.no_e2e:
        e2e = _e2e_rows()
        if e2e:
            append_csv("window_attention", e2e)
            print_table(e2e, ["stage", "variant", "ms", "x_vs_timm_O1"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
