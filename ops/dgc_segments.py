"""``aiak::dgc_segments_select``: DGC's selection for every compressed tensor of one bucket.

Each tensor is a *segment* of the bucket's flat fp32 residual ``x``; a plan (one int64 row per
segment, :func:`dgc_segments_plan`) says where it lies, how many entries it keeps (``k``) and how
it is sampled. Per segment the op computes what DGC's reference ``_sparsify`` computes, in a
fixed output shape: segment ``s`` owns output slots ``[out_off, out_off + k)``, its selected
indices (positions in ``x``) ascending, then padding (index ``-1``, value ``0``).

Importance is ``|x|`` compared as the bit patterns of non-negative fp32 (exact comparisons; NaN
ranks above +inf), as in ``aiak::dgc_select``. Per segment:

1. samples: the whole segment when ``m == n``; else every ``stride``-th importance from
   ``sample_start[s]`` (``ceil((n - s0) / stride)`` of them: ``m`` or ``m + 1``), or the
   importances at ``sample_indices[sample_off : sample_off + m]`` (positions in ``x``);
2. ``thr`` = the ``ks``-th largest sample; ``c = #(importance >= thr)``;
3. only when ``m < n``, up to ``iters`` times: ``c > k`` -> (``c > k * upper`` -> with
   ``resample`` stop and take the exact top-k, else ``thr = fp32(thr * fp32(upper))``; otherwise
   stop); ``c < lower * k`` -> ``thr = fp32(thr * fp32(lower))``; else stop; recount ``c``. The
   threshold is rounded to fp32 at every step, as the reference's 0-d fp32 tensor times a Python
   float is; a NaN threshold keeps its bit pattern (NaN payloads differ between devices);
4. output: the exact top-k (ties to the lowest index) after a resample stop, otherwise the
   first ``k`` indices (ascending) with ``importance >= thr``.

The CUDA kernel (fp32; ops/_dgc_segments_cuda.py) runs a fixed number of launches per call
whatever the number of segments (:func:`launches_per_call`) and never synchronises the host.
The output size ``K = sum(k)`` must be known on the host: the plan of a CPU ``table`` is read
directly; a device ``table`` is copied to the host once (one synchronisation) and that copy is
kept with the tensor object while its version counter is unchanged (the caller caches its
table, so later calls read nothing from the device).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._dgc_segments_cuda import launch_segments, launches_per_call
from aiak.ops._registry import define
from aiak.ops.dgc_select import exact_top_k

__all__ = [
    "dgc_segments_plan",
    "dgc_segments_select",
    "host_plan",
    "launches_per_call",
]

SEGMENTS = declare(Capability("dgc_segments_select", dtypes=(torch.float32,)))
MAX_ITERS = 20
COLS = 8
START, N, K, OUT_OFF, M, KS, STRIDE, SAMPLE_OFF = range(COLS)
_OP = "dgc_segments_select"


def _segment_plan(n: int, ratio: float, sample_ratio: float) -> tuple[int, int, int, int]:
    """(k, m, ks, stride) of one segment: DGC's reference ``initialize`` in float64."""
    sr = min(max(sample_ratio, 0.01), 1.0)
    if sr < 1:
        pct = math.ceil(n * sr)
        cpr = math.ceil(2 / ratio)
        if n <= cpr:
            stride, m = 1, n
        else:
            want = max(pct, cpr)
            stride = math.ceil(n / want / 32) * 32 + 1
            m = n // stride
            while m < want:
                stride -= 8
                m = n // stride
    else:
        stride, m = 1, n
    ks = max(1, math.ceil(m * ratio))
    k = min(n, max(1, math.ceil(n * ratio)))
    return k, m, ks, stride


def dgc_segments_plan(
    lengths: Sequence[int], starts: Sequence[int], ratio: float, sample_ratio: float
) -> torch.Tensor:
    """The plan of segments of ``lengths`` elements at ``starts``: an int64 CPU tensor [S, 8].

    Columns: 0 start, 1 n, 2 k = ceil(n * ratio) in [1, n], 3 out_off (cumulative k),
    4 m (samples), 5 ks = ceil(m * ratio) >= 1, 6 stride (1 when sampled whole),
    7 sample_off (cumulative m).
    """
    if len(lengths) != len(starts):
        raise ValueError(f"dgc_segments_plan: {len(lengths)} lengths but {len(starts)} starts")
    for name, v in (("ratio", ratio), ("sample_ratio", sample_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"dgc_segments_plan: {name} must be a float, got {type(v).__name__}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"dgc_segments_plan: ratio must be in (0, 1], got {ratio}")
    if not sample_ratio >= 0.0:  # also rejects NaN; values below 0.01 count as 0.01
        raise ValueError(f"dgc_segments_plan: sample_ratio must be >= 0, got {sample_ratio}")
    rows = []
    out_off = sample_off = 0
    for i, (n, start) in enumerate(zip(lengths, starts)):
        for name, v in (("lengths", n), ("starts", start)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"dgc_segments_plan: {name}[{i}] must be an int, got {v!r}")
        if n < 1 or start < 0:
            raise ValueError(f"dgc_segments_plan: segment {i} needs n >= 1, start >= 0")
        k, m, ks, stride = _segment_plan(n, float(ratio), float(sample_ratio))
        rows.append((start, n, k, out_off, m, ks, stride, sample_off))
        out_off += k
        sample_off += m
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), COLS)


# --------------------------------------------------------------------------------------------
# The host copy of a plan and the checks
# --------------------------------------------------------------------------------------------


class HostPlan:
    """A checked plan on the host: its rows and totals (K = sum k, M = sum m)."""

    __slots__ = ("K", "M", "__weakref__", "cache", "end", "rows")

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows
        self.K = sum(r[K] for r in rows)
        self.M = sum(r[M] for r in rows)
        self.end = max((r[START] + r[N] for r in rows), default=0)  # x must reach it
        self.cache: dict[Any, Any] = {}  # the CUDA launcher's per-plan device tables


# id(table) -> (weakref to table, its version, its HostPlan); entries go with their tensors
_plans: dict[int, tuple[Any, int, HostPlan]] = {}
_plans_lock = threading.Lock()


def _check_rows(rows: list[list[int]], numel: int) -> None:
    out_off = sample_off = 0
    for i, (start, n, k, oo, m, ks, stride, so) in enumerate(rows):
        where = f"{_OP}: table row {i}"
        if n < 1 or start < 0 or start + n > numel:
            raise ValueError(f"{where}: segment [{start}, {start}+{n}) is not inside x ({numel})")
        if not 1 <= k <= n or not 1 <= m <= n or not 1 <= ks <= m or stride < 1:
            raise ValueError(f"{where}: needs 1 <= k <= n, 1 <= ks <= m <= n, stride >= 1")
        if m < n and m != n // stride:
            raise ValueError(f"{where}: {m} samples do not fit stride {stride} over {n}")
        if oo != out_off or so != sample_off:
            raise ValueError(f"{where}: out_off/sample_off are not the cumulative k/m")
        out_off += k
        sample_off += m


def host_plan(table: torch.Tensor, numel: int) -> HostPlan:
    """The checked host copy of ``table`` (see the module docstring on device tables)."""
    if table.device.type == "cpu":
        rows = table.tolist()
        _check_rows(rows, numel)
        return HostPlan(rows)
    key = id(table)
    entry = _plans.get(key)
    if entry is not None and entry[0]() is table and entry[1] == table._version:
        plan = entry[2]
    else:
        plan = HostPlan(table.tolist())  # one synchronisation per table tensor and version
        _check_rows(plan.rows, numel)
        ref = weakref.ref(table, lambda _r, key=key: _forget(key, _r))
        with _plans_lock:
            _plans[key] = (ref, table._version, plan)
    if plan.end > numel:
        _check_rows(plan.rows, numel)  # a known table with a shorter x: raises
    return plan


def _forget(key: int, ref: Any) -> None:
    with _plans_lock:
        entry = _plans.get(key)
        if entry is not None and entry[0] is ref:
            del _plans[key]


def check(args: tuple) -> HostPlan:
    """The op's arguments (its schema's order), checked; the host plan of ``table``."""
    x, table, sample_start, sample_indices, upper, lower, iters = args[:7]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_OP}: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{_OP}: x has dtype {x.dtype}; supported: float32")
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"{_OP}: x must be 1-D and contiguous, got shape {tuple(x.shape)}")
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64:
        raise TypeError(f"{_OP}: table must be an int64 tensor (dgc_segments_plan)")
    if table.dim() != 2 or table.shape[1] != COLS or table.device != x.device:
        raise ValueError(f"{_OP}: table must be [S, {COLS}] on {x.device}")
    s = table.shape[0]
    if not isinstance(sample_start, torch.Tensor) or sample_start.dtype != torch.int64:
        raise TypeError(f"{_OP}: sample_start must be an int64 tensor")
    if sample_start.shape != (s,) or sample_start.device != x.device:
        raise ValueError(f"{_OP}: sample_start must be [{s}] on {x.device}")
    if not 1.0 < upper <= 3e38:  # fp32(upper) finite: 0 * inf would make a NaN threshold
        raise ValueError(f"{_OP}: upper must be in (1, 3e38], got {upper}")
    if not 0.0 < lower < 1.0:
        raise ValueError(f"{_OP}: lower must be in (0, 1), got {lower}")
    if not 0 <= iters <= MAX_ITERS:
        raise ValueError(f"{_OP}: iters must be in [0, {MAX_ITERS}], got {iters}")
    plan = host_plan(table.contiguous(), x.numel())
    if sample_indices is not None:
        if not isinstance(sample_indices, torch.Tensor) or sample_indices.dtype != torch.int64:
            raise TypeError(f"{_OP}: sample_indices must be an int64 tensor or None")
        if sample_indices.shape != (plan.M,) or sample_indices.device != x.device:
            raise ValueError(f"{_OP}: sample_indices must be [{plan.M}] (sum m) on {x.device}")
    return plan


# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def _scale(thr: int, factor32: float) -> int:
    """fp32 bits of fp32(thr * factor32): the exact double product, rounded once (an fp32
    multiply); a NaN threshold keeps its bits."""
    if thr > 0x7F800000:
        return thr
    t = torch.tensor([thr], dtype=torch.int32).view(torch.float32).double() * factor32
    return int(t.float().view(torch.int32).item())


def _fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).float())


def _select_segment(
    seg: torch.Tensor, samples: torch.Tensor, row: list[int], loop: tuple
) -> torch.Tensor:
    """Local indices selected in one segment (int32 importance bits ``seg``), ascending."""
    _, n, k, _, m, ks, _, _ = row
    upper, lower, iters, resample = loop
    thr = int(torch.topk(samples.long(), ks).values[-1])
    c = int((seg >= thr).sum())
    exact = False
    if m < n:
        up32, low32 = _fp32(upper), _fp32(lower)
        for _ in range(iters):
            if c > k:
                if c > k * upper:
                    if resample:
                        exact = True
                        break
                    thr = _scale(thr, up32)
                else:
                    break
            elif c < lower * k:
                thr = _scale(thr, low32)
            else:
                break
            c = int((seg >= thr).sum())
    sel = exact_top_k(seg, k) if exact else seg >= thr
    return torch.nonzero(sel).reshape(-1)[:k]


def _reference(
    x: torch.Tensor,
    table: torch.Tensor,
    sample_start: torch.Tensor,
    sample_indices: torch.Tensor | None,
    upper: float,
    lower: float,
    iters: int,
    resample: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = check((x, table, sample_start, sample_indices, upper, lower, iters))
    values = torch.zeros(plan.K, dtype=torch.float32, device=x.device)
    indices = torch.full((plan.K,), -1, dtype=torch.int64, device=x.device)
    if not plan.rows:
        return values, indices
    xc = x.cpu()
    bits = xc.view(torch.int32) & 0x7FFFFFFF
    starts = sample_start.tolist()
    sidx = None if sample_indices is None else sample_indices.cpu()
    out_v = torch.zeros(plan.K, dtype=torch.float32)
    out_i = torch.full((plan.K,), -1, dtype=torch.int64)
    loop = (upper, lower, iters, resample)
    for row, s0 in zip(plan.rows, starts):
        start, n, _, out_off, m, _, stride, sample_off = row
        seg = bits[start : start + n]
        if m == n:
            samples = seg
        elif sidx is None:
            if not 0 <= s0 < stride:
                raise ValueError(f"{_OP}: sample_start {s0} is not in [0, stride={stride})")
            samples = seg[s0::stride]
        else:
            pos = sidx[sample_off : sample_off + m]
            if bool(((pos < 0) | (pos >= x.numel())).any()):
                raise ValueError(f"{_OP}: sample_indices must be positions in x")
            samples = bits[pos]
        idx = _select_segment(seg, samples, row, loop) + start
        out_i[out_off : out_off + idx.numel()] = idx
        out_v[out_off : out_off + idx.numel()] = xc[idx]
    return values.copy_(out_v), indices.copy_(out_i)


def _fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = args[0]
    total = torch.library.get_ctx().new_dynamic_size()  # K = sum of the table's k
    return x.new_empty(total), x.new_empty(total, dtype=torch.int64)


def _select_cuda(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernels; arguments as in the op's schema (:func:`_reference`)."""
    x = args[0]
    plan = check(args)
    if not plan.rows or not use_kernel(SEGMENTS, x.device, (x.dtype,)):
        return _reference(*args)
    return launch_segments(args, plan)


SEGMENTS_OP = define(
    "dgc_segments_select(Tensor x, Tensor table, Tensor sample_start, "
    "Tensor? sample_indices, float upper, float lower, int iters, bool resample) "
    "-> (Tensor, Tensor)",
    _reference,
    cuda=_select_cuda,
    fake=_fake,
)


def dgc_segments_select(
    x: torch.Tensor,
    table: torch.Tensor,
    sample_start: torch.Tensor,
    sample_indices: torch.Tensor | None = None,
    upper: float = 1.3,
    lower: float = 0.8,
    iters: int = 10,
    resample: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's selection in every segment of ``x`` planned by ``table`` (module docstring).

    Returns ``(values fp32 [K], indices int64 [K])``, ``K`` the sum of the plan's ``k``.
    """
    if isinstance(iters, bool) or not isinstance(iters, int):
        raise TypeError(f"{_OP}: iters must be an int, got {type(iters).__name__}")
    for name, v in (("upper", upper), ("lower", lower)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{_OP}: {name} must be a float, got {type(v).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_OP}: x must be a tensor, got {type(x).__name__}")
    return SEGMENTS_OP(
        x, table, sample_start, sample_indices, float(upper), float(lower), iters, bool(resample)
    )
