"""DGC's per-segment selection written in numpy from its description (docs/ops.md,
``aiak::dgc_segments_select``), independent of the op's code: the plan in float64 Python
arithmetic, thresholds scaled by numpy fp32 multiplies, counts and top-k by numpy sorts."""

from __future__ import annotations

import math

import numpy as np
import torch


def plan_rows(lengths, starts, ratio, sample_ratio):
    """[start, n, k, out_off, m, ks, stride, sample_off] per segment."""
    rows, out_off, sample_off = [], 0, 0
    sr = min(max(sample_ratio, 0.01), 1.0)
    for n, start in zip(lengths, starts):
        stride, m = 1, n
        if sr < 1:
            pct, cpr = math.ceil(n * sr), math.ceil(2 / ratio)
            if n > cpr:
                stride = math.ceil(n / max(pct, cpr) / 32) * 32 + 1
                m = n // stride
                while m < max(pct, cpr):
                    stride -= 8
                    m = n // stride
        k = min(n, max(1, math.ceil(n * ratio)))
        ks = max(1, math.ceil(m * ratio))
        rows.append([start, n, k, out_off, m, ks, stride, sample_off])
        out_off += k
        sample_off += m
    return rows


def _times(thr: int, factor: float) -> int:
    if thr > 0x7F800000:  # a NaN threshold keeps its bits
        return thr
    f = np.array([thr], dtype=np.int32).view(np.float32)
    return int((f * np.float32(factor)).view(np.int32)[0])


def select(x, rows, s0s, sample_indices, upper, lower, iters, resample):
    """(values float64 [K], indices int64 [K]) for fp32 numpy ``x``."""
    imp = (x.view(np.int32) & 0x7FFFFFFF).astype(np.int64)
    total = sum(r[2] for r in rows)
    values = np.zeros(total)
    indices = np.full(total, -1, dtype=np.int64)
    for r, s0 in zip(rows, s0s):
        start, n, k, out_off, m, ks, stride, soff = r
        seg = imp[start : start + n]
        if m == n:
            samples = seg
        elif sample_indices is None:
            samples = seg[s0::stride]
        else:
            samples = imp[sample_indices[soff : soff + m]]
        thr = int(np.sort(samples)[::-1][ks - 1])
        c = int((seg >= thr).sum())
        exact = False
        if m < n:
            for _ in range(iters):
                if c > k:
                    if c > k * upper:
                        if resample:
                            exact = True
                            break
                        thr = _times(thr, upper)
                    else:
                        break
                elif c < lower * k:
                    thr = _times(thr, lower)
                else:
                    break
                c = int((seg >= thr).sum())
        if exact:
            order = np.lexsort((np.arange(n), -seg))  # largest first, ties to the lowest index
            sel = np.sort(order[:k])
        else:
            sel = np.nonzero(seg >= thr)[0][:k]
        indices[out_off : out_off + sel.size] = sel + start
        values[out_off : out_off + sel.size] = x[sel + start].astype(np.float64)
    return values, indices


def dgc_data(n: int, kind: str, seed: int) -> torch.Tensor:
    """Test data of ``n`` fp32 values: normal, heavy, ties, special or (any other) ramp."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "heavy":  # a few large entries: the sample misses them, the loop adapts
        x = torch.randn(n, generator=g) * 1e-3
        x[torch.randint(0, n, (max(1, n // 500),), generator=g)] *= 1e4
        return x
    if kind == "ties":  # few distinct values: the resample branch and tie breaking
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "special":  # NaN, +-inf, zeros, subnormals
        x = torch.randn(n, generator=g)
        pick = torch.randint(0, 6, (n,), generator=g)
        x[pick == 0] = float("nan")
        x[pick == 1] = float("inf")
        x[pick == 2] = -float("inf")
        x[pick == 3] = 0.0
        x[pick == 4] *= 1e-39
        return x
    return torch.linspace(-1, 1, n)  # "ramp": sampled strides alias with the structure
