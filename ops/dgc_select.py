"""``aiak::dgc_select``: Deep Gradient Compression's selection (sample, threshold, adapt, compact).

Returns exactly ``k`` (value, index) pairs of a flat tensor ``x`` with a fixed shape, so a
caller can allgather them without asking the device how many there are. Fewer than ``k``
selected: the tail is padded with index ``-1`` and value ``0``. Indices are in ascending order.

The algorithm, on ``importance = |x|`` compared as the bit patterns of non-negative fp32
values (so comparisons are exact and NaN ranks above +inf):

1. sample ``num_samples`` importances: ``sample_indices`` when given, else every
   ``sample_stride``-th from ``sample_start``;
2. ``thr0`` = the ``k_s``-th largest sample, ``k_s = ceil(num_samples * k / numel)``;
3. adaptation, exactly the seed's loop, with the threshold of state (a, b) defined as
   ``fp32(thr0 * upper**a * lower**b)`` (float64 products in that order, rounded once):
   ``c = #(importance >= thr)``; up to ``iters`` times: ``c > upper*k`` -> with ``resample``
   stop and take the exact top-k, else ``a += 1``; ``c < lower*k`` -> ``b += 1``; else stop;
4. compaction: the exact top-k (ties to the lowest index) after a resample stop, otherwise
   the first ``k`` indices (ascending) with ``importance >= thr``.

How it relates to the seed: the seed multiplies its threshold in place (rounding at every
step) and counts with one pass per iteration; here every threshold the loop can reach (``iters
+ 1`` of them with ``resample``, ``(iters+1)(iters+2)/2`` without) is counted in ONE pass, the
loop then runs on the counts, so the work is fixed and nothing waits on the host. Decisions
are the seed's except where a threshold's single rounding differs from its repeated one.

The CUDA kernel (fp32 only; other dtypes run this reference) computes the same thing bit for
bit in 8 launches (4 when no resample stop can happen) and one read of ``x`` in the common
case: thr0 by radix digits on a compact sample copy, one counting pass that also keeps each
tile's few candidates, the loop in that pass's last block, the exact top-k gated on the
device, and an ordered write from the candidates (docs/dgc.md). Never syncs the host. Its
workspace is allocated once per (device, stream, sizes) and reused.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from aiak.ops import _cuda
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._registry import define

__all__ = ["dgc_plan", "dgc_select", "dgc_thresholds", "launches_per_call"]

SELECT = declare(Capability("dgc_select", dtypes=(torch.float32,)))
_SOURCE = "dgc_select.cu"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ITERS = 20  # (21 * 22) / 2 = 231 thresholds at most without resample
_TILE = 4096  # elements per tile of the counting and compaction passes (TILE in the .cu)
_BLOCK = 256
_NREG = 12  # thresholds the counting kernel keeps in registers (NREG in the .cu)
_WCHUNK = 32  # tiles per block of the ordered write (WCHUNK in the .cu)


def _check(
    x: torch.Tensor,
    k: int,
    num_samples: int,
    sample_start: int,
    sample_stride: int,
    sample_indices: torch.Tensor | None,
    upper: float,
    lower: float,
    iters: int,
) -> None:
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
    _check(x, k, num_samples, sample_start, sample_stride, sample_indices, upper, lower, iters)
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
    if exact:
        v = int(torch.topk(bits.long(), k).values[-1])
        greater = bits > v
        equal = bits == v
        room = k - int(greater.sum())
        sel = greater | (equal & (torch.cumsum(equal, 0) <= room))
    else:
        sel = bits >= thr
    idx = torch.nonzero(sel).reshape(-1)[:k]
    indices[: idx.numel()] = idx
    values[: idx.numel()] = flat[idx]
    return values, indices


def _capacity(k: int, tiles: int) -> int:
    """Candidate slots per tile: 8x the mean selected per tile, in [64, 1024], a multiple of 32."""
    want = -(-8 * k // tiles)
    return min(1024, max(64, -(-want // 32) * 32))


def _r16(nbytes: int) -> int:
    return (nbytes + 15) & ~15


def _workspace_bytes(m: int, tiles: int, nthr: int, cap: int) -> int:
    """Bytes of the workspace: the layout of ``carve`` in dgc_select.cu."""
    fixed = 256 + 2048 * 8 + 256 * 8 + 3 * 256 * 4  # plan, histogram, totals, 3 tables
    per = 2 * _r16(4 * m) + _r16(4 * nthr * tiles) + 3 * _r16(4 * tiles)
    return fixed + per + _r16(4 * tiles * cap) + _r16(2 * tiles * cap)


class _Workspace:
    """One zeroed buffer, its launch geometry and kernels, for (device, stream, n, m, nthr, cap)."""

    __slots__ = ("buf", "fns", "geom", "grids")

    def __init__(self, dev: torch.device, n: int, m: int, nthr: int, cap: int) -> None:
        import numpy as np

        tiles = -(-n // _TILE)
        nbytes = _workspace_bytes(m, tiles, nthr, cap)
        # zeroed once: every call leaves its counters, histograms and totals zero again
        self.buf = torch.zeros(-(-nbytes // 8), dtype=torch.int64, device=dev)
        sms = _cuda.num_sms(torch.cuda.current_device())
        self.geom = (
            _cuda.ptr(self.buf),
            np.int64(n),
            np.int64(m),
            np.int64(tiles),
            np.int32(nthr),
            np.int32(cap),
        )
        self.grids = (
            max(1, min(-(-m // (4 * _BLOCK)), 4 * sms)),  # sample_hist: 4 gathers per thread
            max(1, min(-(-m // _BLOCK), 4 * sms)),  # sample_finish
            min(tiles, 4 * sms),  # count, exact_hist, exact_counts: tiles in a grid stride
            -(-tiles // _WCHUNK),  # write
        )
        count = "dgc_count_reg" if nthr <= _NREG else "dgc_count_search"
        self.fns = {
            name: _cuda.get_function(_SOURCE, name)
            for name in (
                "dgc_sample_hist",
                "dgc_sample_finish",
                "dgc_exact_hist",
                "dgc_exact_counts",
                "dgc_write",
            )
        }
        self.fns["count"] = _cuda.get_function(_SOURCE, count)


# Workspaces are kept per (device, stream, n, num_samples, thresholds, capacity): a DGC hook
# calls the op with the same sizes every step, and two streams never share one (the kernels
# keep counters in it). At most _WS_KEEP of them; the least recently used is dropped first.
_WS_KEEP = 64
_workspaces: OrderedDict[tuple, _Workspace] = OrderedDict()
_ws_lock = threading.Lock()


def _workspace(dev: torch.device, n: int, m: int, nthr: int, cap: int) -> _Workspace:
    key = (dev.index, torch.cuda.current_stream(dev).cuda_stream, n, m, nthr, cap)
    with _ws_lock:
        ws = _workspaces.get(key)
        if ws is not None:
            _workspaces.move_to_end(key)
            return ws
    ws = _Workspace(dev, n, m, nthr, cap)
    with _ws_lock:
        _workspaces[key] = ws
        while len(_workspaces) > _WS_KEEP:
            _workspaces.popitem(last=False)
    return ws


def launches_per_call(resample: bool, iters: int) -> int:
    """Kernel launches of one CUDA call: 8, or 4 when no resample stop can happen."""
    return 8 if resample and iters > 0 else 4


def _select_cuda(
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
    _check(x, k, num_samples, sample_start, sample_stride, sample_indices, upper, lower, iters)
    if k == 0 or not use_kernel(SELECT, x.device, (x.dtype,)):
        return _reference(
            x, k, num_samples, sample_start, sample_stride, sample_indices, upper, lower, iters,
            resample,
        )  # fmt: skip
    import numpy as np  # only on the CUDA path: `import aiak.ops` stays free of numpy

    n = x.numel()
    dev = x.device
    m = num_samples
    tiles = -(-n // _TILE)
    nthr = iters + 1 if resample else (iters + 1) * (iters + 2) // 2
    # every slot is written by dgc_write: the selected entries, then the (-1, 0) padding
    values = torch.empty(k, dtype=x.dtype, device=dev)
    indices = torch.empty(k, dtype=torch.int64, device=dev)
    if sample_indices is not None:
        sample_indices = sample_indices.contiguous()
    p = _cuda.ptr
    px = p(x)
    vec = np.int32(1 if x.data_ptr() % 16 == 0 else 0)  # float4 loads need 16-byte alignment
    ks = min(m, max(1, (m * k + n - 1) // n))
    with _cuda.on_device(dev):
        ws = _workspace(dev, n, m, nthr, _capacity(k, tiles))
        f, geom, (g_hist, g_finish, g_tiles, g_write) = ws.fns, ws.geom, ws.grids
        up, lo = np.float64(upper), np.float64(lower)
        it, rs = np.int32(iters), np.int32(1 if resample else 0)
        launch = _cuda.launch
        launch(
            f["dgc_sample_hist"], g_hist, _BLOCK,
            (px, p(sample_indices), *geom, np.int64(sample_start), np.int64(sample_stride),
             np.int64(ks)),
        )  # fmt: skip
        launch(f["dgc_sample_finish"], g_finish, _BLOCK, (*geom, up, lo, it, rs))
        launch(f["count"], g_tiles, _BLOCK, (px, *geom, vec, np.int64(k), up, lo, it, rs))
        if resample and iters > 0:  # exact top-k after a resample stop, gated on the device
            for digit in range(3):
                launch(f["dgc_exact_hist"], g_tiles, _BLOCK, (px, *geom, vec, np.int32(digit)))
            launch(f["dgc_exact_counts"], g_tiles, _BLOCK, (px, *geom, vec))
        launch(
            f["dgc_write"], g_write, _BLOCK,
            (px, *geom, vec, np.int64(k), p(values), p(indices)),
        )  # fmt: skip
    return values, indices


def _fake(
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
