"""DGC's selection algorithm in float64 numpy, written from its definition (docs/dgc.md), for
the tests of ``aiak::dgc_select`` and of the DGC hook. Not collected by pytest."""

from __future__ import annotations

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
