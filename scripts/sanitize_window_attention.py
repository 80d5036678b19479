"""A tiny run of every window-attention kernel, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_window_attention.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_window_attention.py

Forward and backward of both kernel pairs (``mma`` in every forward and backward variant,
``scalar``) for fp16/bf16, D = 32/64,
N = 49 (padded tiles), 64 and 13, with and without the mask, a strided q/k/v view, and one
mma case with enough heads that every block loops over several windows (its shared tiles
are reused, its bias gradient summed across windows); both gathers at 16-byte and 2-byte word
widths. Exits non-zero when a result is off the reference.
"""

from __future__ import annotations

import sys

import torch

from aiak.ops import _window_attention_cuda as wac
from aiak.ops import _window_attention_kernels as wak
from aiak.ops import _window_attention_ref as war
from aiak.ops import window_partition as wp


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    cases = [  # (kernels, dtype, windows, heads, n, d, nW)
        (wac.KERNEL_CHOICES, dtype, 8, 2, n, d, nw)
        for dtype in (torch.float16, torch.bfloat16)
        for n, d, nw in ((49, 32, 4), (64, 64, None), (13, 32, 2))
    ]
    # many heads, few windows: every mma block loops over several windows (G is ~4 to 12)
    cases.append((("mma",), torch.float16, 48, 48, 49, 32, 4))
    variants = [("base", b) for b in wak.BWD_VARIANTS]
    variants += [(f, "base") for f in wak.FWD_VARIANTS if f != "base"]
    for kernels, dtype, windows, heads, n, d, nw in cases:
        runs = [
            (kernel, f, b)
            for kernel in kernels
            for f, b in (variants if kernel == "mma" else [("base", "base")])
        ]
        for kernel, fwd, bwd in runs:
            x = torch.randn(windows, n, 3, heads, d, device="cuda", dtype=dtype)
            q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
            bias = torch.randn(heads, n, n, device="cuda")
            mask = torch.randn(nw, n, n, device="cuda") if nw else None
            out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.2, True, fwd)
            ref = war._attention_reference(q, k, v, bias, mask, 0.2, True)
            dout = torch.randn_like(out).transpose(1, 2)  # as autograd hands it over
            got = wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, 0.2, bwd)
            want = war._attention_backward_reference(dout, q, k, v, bias, mask, 0.2)
            pairs = [(out, ref), *zip(got, want)]
            for a, b in pairs:
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                if not err < 5e-2:
                    where = f"{kernel} {fwd}/{bwd} {dtype} windows={windows} n={n} d={d}"
                    print(f"{where}: rel err {err:.3g}")
                    bad += 1
    for c in (8, 3):
        x = torch.randn(2, 14, 14, c, device="cuda", dtype=torch.float16)
        win = wp._partition_cuda(x, 7, 3)
        bad += not torch.equal(win, wp._partition_reference(x, 7, 3))
        bad += not torch.equal(wp._merge_cuda(win, 14, 14, 3), x)
    torch.cuda.synchronize()
    print("ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
