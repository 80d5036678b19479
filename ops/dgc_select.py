"""``aiak::dgc_select``: Deep Gradient Compression's selection (sample, threshold, adapt, compact).

Returns exactly ``k`` (value, index) pairs of a flat tensor ``x`` with a fixed shape, so a
caller can allgather them without asking the device how many there are. Fewer than ``k``
selected: the tail is padded with index ``-1`` and value ``0``. Indices are in ascending order.

The algorithm, on ``importance = |x|`` compared as the bit patterns of non-negative fp32
values (so comparisons are exact and NaN ranks above +inf):

1. sample ``num_samples`` importances: ``sample_indices`` when given, else every
   ``sample_stride``-th from ``sample_start``;
2. ``thr0`` = the ``k_s``-th largest sample, ``k_s = ceil(num_samples * k / numel)``;
3. adaptation, exactly AIAK-Training's DGC loop, with the threshold of state (a, b) defined as
   ``fp32(thr0 * upper**a * lower**b)`` (float64 products in that order, rounded once):
   ``c = #(importance >= thr)``; up to ``iters`` times: ``c > upper*k`` -> with ``resample``
   stop and take the exact top-k, else ``a += 1``; ``c < lower*k`` -> ``b += 1``; else stop;
4. compaction: the exact top-k (ties to the lowest index) after a resample stop, otherwise
   the first ``k`` indices (ascending) with ``importance >= thr``.

How it relates to AIAK-Training's DGC: that loop multiplies its threshold in place (rounding at
every step) and counts with one pass per iteration; here every threshold the loop can reach (``iters
+ 1`` of them with ``resample``, ``(iters+1)(iters+2)/2`` without) is counted in ONE pass, the
loop then runs on the counts, so the work is fixed and nothing waits on the host. Decisions
are that loop's except where a threshold's single rounding differs from its repeated one.

The CUDA kernel (fp32 only; other dtypes run this reference) computes the same thing bit for
bit in 9 launches (4 when no resample stop can happen) and one read of ``x`` in the common
case: thr0 by radix digits on a compact sample copy, one counting pass that also keeps each
tile's few candidates (with ``resample``: of the loop's first 4 states only, then of all of
them in a second pass gated on the device when the loop needs more), the loop in that pass's
last block, the exact top-k gated on the
device, and an ordered write from the candidates (docs/dgc.md). Never syncs the host. Its
workspace is allocated once per (device, stream, sizes) and reused; the launcher and that
cache are ops/_dgc_select_cuda.py.
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._dgc_select_cuda import NFAST, launch_select
from aiak.ops._registry import define

__all__ = ["dgc_plan", "dgc_select", "dgc_thresholds", "launches_per_call"]

SELECT = declare(Capability("dgc_select", dtypes=(torch.float32,)))
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ITERS = 20  # (21 * 22) / 2 = 231 thresholds at most without resample


def _check(args: tuple) -> None:
    """The op's arguments, in its schema's order (``resample``, a bool, needs no check)."""
    x, k, num_samples, sample_start, sample_stride, sample_indices, upper, lower, iters = args[:9]
    op = "dgc_select"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous; call .contiguous() first")
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"{op}: k must be in [0, numel={n}], got {k}")
    if k == 0:
        return
    if sample_indices is not None:
        if not isinstance(sample_indices, torch.Tensor) or sample_indices.dtype != torch.int64:
            raise TypeError(f"{op}: sample_indices must be an int64 tensor or None")
        if sample_indices.device != x.device or sample_indices.dim() != 1:
            raise ValueError(f"{op}: sample_indices must be 1-D and on {x.device}")
        if sample_indices.numel() != num_samples:
            raise ValueError(
                f"{op}: sample_indices has {sample_indices.numel()} entries, num_samples is "
                f"{num_samples}"
            )
    if not 1 <= num_samples <= n:
        raise ValueError(f"{op}: num_samples must be in [1, numel={n}], got {num_samples}")
    if sample_indices is None:
        if sample_stride < 1:
            raise ValueError(f"{op}: sample_stride must be >= 1, got {sample_stride}")
        if sample_start < 0 or sample_start + (num_samples - 1) * sample_stride >= n:
            raise ValueError(
                f"{op}: samples at {sample_start} + i * {sample_stride}, i < {num_samples}, "
                f"leave the tensor of {n} elements"
            )
    if not upper > 1.0:
        raise ValueError(f"{op}: upper must be > 1, got {upper}")
    if not 0.0 < lower < 1.0:
        raise ValueError(f"{op}: lower must be in (0, 1), got {lower}")
    if not 0 <= iters <= MAX_ITERS:
        raise ValueError(f"{op}: iters must be in [0, {MAX_ITERS}], got {iters}")


def dgc_thresholds(
    thr0_bits: int, upper: float, lower: float, iters: int, resample: bool
) -> dict[tuple[int, int], int]:
    """{(a, b): fp32 bits of thr0 * upper**a * lower**b} for every state the loop can reach."""
    t0 = torch.tensor([thr0_bits], dtype=torch.int32).view(torch.float32).item()
    out: dict[tuple[int, int], int] = {}
    states = [(0, b) for b in range(iters + 1)]
    if not resample:
        states = [(a, b) for a in range(iters + 1) for b in range(iters + 1 - a)]
    for a, b in states:
        t = t0
        for _ in range(a):
            t *= upper
        for _ in range(b):
            t *= lower
        out[a, b] = int(torch.tensor([t], dtype=torch.float64).float().view(torch.int32).item())
    return out


def dgc_plan(
    bits: torch.Tensor,
    k: int,
    samples: torch.Tensor,
    upper: float,
    lower: float,
    iters: int,
    resample: bool,
) -> tuple[bool, int, int]:
    """The adaptation loop on int32 importance ``bits``: (exact top-k?, threshold bits, count)."""
    n, m = bits.numel(), samples.numel()
    ks = min(m, max(1, (m * k + n - 1) // n))
    thr0 = int(torch.topk(samples.long(), ks).values[-1])
    thr = dgc_thresholds(thr0, upper, lower, iters, resample)

    def count(a: int, b: int) -> int:
        return int((bits >= thr[a, b]).sum())

    a = b = 0
    c = count(a, b)
    for _ in range(iters):
        if c > upper * k:
            if resample:
                return True, thr[a, b], c
            a += 1
        elif c < lower * k:
            b += 1
        else:
            break
        c = count(a, b)
    return False, thr[a, b], c


def exact_top_k(bits: torch.Tensor, k: int) -> torch.Tensor:
    """The mask of the ``k`` largest of int32 importance ``bits``, ties to the lowest index."""
    v = int(torch.topk(bits.long(), k).values[-1])
    greater = bits > v
    equal = bits == v
    room = k - int(greater.sum())
    return greater | (equal & (torch.cumsum(equal, 0) <= room))


def _reference(
    x: torch.Tensor,
    k: int,
    num_samples: int,
    sample_start: int,
    sample_stride: int,
    sample_indices: torch.Tensor | None,
    upper: float,
    lower: float,
    iters: int,
    resample: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check((x, k, num_samples, sample_start, sample_stride, sample_indices, upper, lower, iters))
    flat = x.reshape(-1)
    values = torch.zeros(k, dtype=x.dtype, device=x.device)
    indices = torch.full((k,), -1, dtype=torch.int64, device=x.device)
    if k == 0:
        return values, indices
    bits = flat.float().abs().view(torch.int32)
    if sample_indices is not None:
        samples = bits[sample_indices]
    else:
        samples = bits[sample_start : sample_start + (num_samples - 1) * sample_stride + 1][
            ::sample_stride
        ]
    exact, thr, _ = dgc_plan(bits, k, samples, upper, lower, iters, resample)
    sel = exact_top_k(bits, k) if exact else bits >= thr
    idx = torch.nonzero(sel).reshape(-1)[:k]
    indices[: idx.numel()] = idx
    values[: idx.numel()] = flat[idx]
    return values, indices


def launches_per_call(resample: bool, iters: int) -> int:
    """Kernel launches of one CUDA call: 4 when no resample stop can happen, else 8, and 9 when
    a fast count of the loop's first states comes before the (gated) full one."""
    if not (resample and iters > 0):
        return 4
    return 9 if iters + 1 > NFAST else 8


def _select_cuda(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel; arguments as in the op's schema (:func:`_reference`)."""
    x, k = args[:2]
    _check(args)
    if k == 0 or not use_kernel(SELECT, x.device, (x.dtype,)):
        return _reference(*args)
    return launch_select(args)


def _fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, k = args[:2]
    if not 0 <= k <= x.numel():
        raise ValueError(f"dgc_select: k must be in [0, numel={x.numel()}], got {k}")
    return x.new_empty(k), x.new_empty(k, dtype=torch.int64)


SELECT_OP = define(
    "dgc_select(Tensor x, int k, int num_samples, int sample_start, int sample_stride, "
    "Tensor? sample_indices, float upper, float lower, int iters, bool resample) "
    "-> (Tensor, Tensor)",
    _reference,
    cuda=_select_cuda,
    fake=_fake,
)


def dgc_select(
    x: torch.Tensor,
    k: int,
    num_samples: int,
    sample_start: int = 0,
    sample_stride: int = 1,
    sample_indices: torch.Tensor | None = None,
    upper: float = 1.3,
    lower: float = 0.8,
    iters: int = 10,
    resample: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's selection of ``k`` entries of contiguous ``x`` (see the module docstring).

    Returns ``(values, indices)``, both of length ``k``: values in ``x``'s dtype, int64
    indices into ``x.reshape(-1)`` in ascending order, padded with ``-1``/``0``.
    """
    for name, v in (
        ("k", k),
        ("num_samples", num_samples),
        ("sample_start", sample_start),
        ("sample_stride", sample_stride),
        ("iters", iters),
    ):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"dgc_select: {name} must be an int, got {type(v).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"dgc_select: x must be a tensor, got {type(x).__name__}")
    return SELECT_OP(
        x,
        k,
        num_samples,
        sample_start,
        sample_stride,
        sample_indices,
        float(upper),
        float(lower),
        iters,
        bool(resample),
    )
