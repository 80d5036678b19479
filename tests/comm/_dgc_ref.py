"""DGC's selection algorithms in float64 numpy, written from their definitions (docs/dgc.md), for
the tests of ``aiak::dgc_select`` and of the DGC hook. Not collected by pytest."""

from __future__ import annotations

import math

import numpy as np


def _f32(t: float) -> float:
    """Round a float64 once to float32 (overflow -> inf), back as float64."""
    with np.errstate(over="ignore"):
        return float(np.float64(np.float32(t)))


def select_f64(
    x: np.ndarray,
    k: int,
    num_samples: int,
    start: int,
    stride: int,
    upper: float,
    lower: float,
    iters: int,
    resample: bool,
    sample_indices: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) of length k, padded with 0 / -1, indices ascending."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    imp = np.abs(flat).astype(np.float64)  # exact: float32 values
    n = imp.size
    if sample_indices is not None:
        samples = imp[sample_indices]
    else:
        samples = imp[start : start + (num_samples - 1) * stride + 1 : stride]
    m = samples.size
    ks = min(m, max(1, -(-m * k // n)))
    thr0 = np.sort(samples)[::-1][ks - 1]

    def thr(a: int, b: int) -> float:
        t = thr0
        for _ in range(a):
            t *= upper
        for _ in range(b):
            t *= lower
        return _f32(t)

    def count(t: float) -> int:
        return int((imp >= t).sum())

    a = b = 0
    c = count(thr(a, b))
    exact = False
    for _ in range(iters):
        if c > upper * k:
            if resample:
                exact = True
                break
            a += 1
        elif c < lower * k:
            b += 1
        else:
            break
        c = count(thr(a, b))
    if exact:
        order = np.lexsort((np.arange(n), -imp))  # largest first, ties by lowest index
        idx = np.sort(order[:k])
    else:
        idx = np.nonzero(imp >= thr(a, b))[0][:k]
    values = np.zeros(k, dtype=np.float64)
    indices = np.full(k, -1, dtype=np.int64)
    values[: idx.size] = flat[idx]
    indices[: idx.size] = idx
    return values, indices


def plan_f64(n: int, ratio: float, sample_ratio: float) -> tuple[int, int, int, int]:
    """``(k, num_samples, k_s, stride)`` of one tensor by DGC's reference rules (docs/dgc.md):
    sample ratio floored at 0.01, at least ``2 / ratio`` samples, an odd stride, a tensor of
    at most ``2 / ratio`` elements sampled whole, ``k_s`` from the sample count."""
    sr = min(max(sample_ratio, 0.01), 1.0)
    k = min(n, max(1, math.ceil(n * ratio)))
    cpr = math.ceil(2 / ratio)
    if sr >= 1.0 or n <= cpr:
        stride, m = 1, n
    else:
        want = max(math.ceil(n * sr), cpr)
        stride = math.ceil(n / want / 32) * 32 + 1
        m = n // stride
        while m < want:
            stride -= 8
            m = n // stride
    return k, m, min(m, max(1, math.ceil(m * ratio))), stride


def sparsify_f64(
    x: np.ndarray,
    ratio: float,
    sample_ratio: float,
    samples_at: np.ndarray,
    upper: float,
    lower: float,
    iters: int,
    resample: bool,
) -> np.ndarray:
    """Indices (ascending, padded with -1 to k) DGC selects from one tensor ``x``;
    ``samples_at`` are the sampled positions (strided: ``start::stride``, ``m`` or ``m + 1`` of
    them). The threshold is the ``k_s``-th largest sample, an fp32 number multiplied in fp32
    at every adaptation step; no adaptation when the whole tensor is sampled."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    imp = np.abs(flat).astype(np.float64)  # exact: float32 values; NaN would need bit order
    n = imp.size
    k, m, ks, _ = plan_f64(n, ratio, sample_ratio)
    samples = imp[samples_at]
    thr = np.float32(np.sort(samples)[::-1][ks - 1])
    up, low = np.float32(upper), np.float32(lower)
    count = int((imp >= thr).sum())
    exact = False
    if m < n:
        for _ in range(iters):
            if count > k:
                if count > k * upper:
                    if resample:
                        exact = True
                        break
                    thr = np.float32(thr * up)
                else:
                    break
            elif count < lower * k:
                thr = np.float32(thr * low)
            else:
                break
            count = int((imp >= thr).sum())
    if exact:
        order = np.lexsort((np.arange(n), -imp))  # largest first, ties by lowest index
        idx = np.sort(order[:k])
    else:
        idx = np.nonzero(imp >= thr)[0][:k]
    out = np.full(k, -1, dtype=np.int64)
    out[: idx.size] = idx
    return out
