"""The CUDA launcher of ``aiak::dgc_select`` (ops/dgc_select.py holds the checks, the
reference and the op): fp32 ``x``, 9 launches of ops/kernels/dgc_select.cu (4 when no resample
stop can happen), a workspace allocated once per (device, stream, sizes) and reused.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from aiak.ops import _cuda
from aiak.ops._driver import Kernel

_SOURCE = "dgc_select.cu"
_DEFINES = _cuda.defines(_SOURCE)
_TILE = _DEFINES["TILE"]  # elements per tile of the counting and compaction passes
_BLOCK = _DEFINES["BLOCK"]
_NREG = _DEFINES["NREG"]  # thresholds the counting kernel keeps in registers
NFAST = _DEFINES["NFAST"]  # thresholds of the fast count (resample mode)
_WCHUNK = _DEFINES["WCHUNK"]  # tiles per block of the ordered write


def _capacity(k: int, tiles: int) -> int:
    """Candidate slots per tile: 8x the mean selected per tile, in [64, 1024], a multiple of 32."""
    want = -(-8 * k // tiles)
    return min(1024, max(64, -(-want // 32) * 32))


def _r16(nbytes: int) -> int:
    return (nbytes + 15) & ~15


# The plan, histogram and totals: the bytes a call expects zero (its last blocks leave them so);
# everything after them is written before it is read.
_ZEROED_BYTES = 256 + 2048 * 8 + 256 * 8


def _workspace_bytes(m: int, tiles: int, nthr: int, cap: int) -> int:
    """Bytes of the workspace: the layout of ``carve`` in dgc_select.cu."""
    fixed = _ZEROED_BYTES + 3 * 256 * 4  # plan, histogram, totals, 3 tables
    per = 2 * _r16(4 * m) + _r16(4 * nthr * tiles) + 3 * _r16(4 * tiles)
    return fixed + per + _r16(4 * tiles * cap) + _r16(2 * tiles * cap)


_GEOM = "ptr base, i64 n, i64 m, i64 tiles, i32 nthr, i32 cap, "
_LOOP = "f64 upper, f64 lower, i32 iters, i32 resample"
_PARAMS = {
    "dgc_sample_hist": "ptr x, ptr sidx, " + _GEOM + "i64 start, i64 stride, i64 ks",
    "dgc_sample_finish": _GEOM + _LOOP,
    "dgc_count_fast": "ptr x, " + _GEOM + "i32 vec, i64 k, " + _LOOP,
    "dgc_count_reg": "ptr x, " + _GEOM + "i32 vec, i64 k, " + _LOOP + ", i32 gate",
    "dgc_count_search": "ptr x, " + _GEOM + "i32 vec, i64 k, " + _LOOP + ", i32 gate",
    "dgc_exact_hist": "ptr x, " + _GEOM + "i32 vec, i32 pass",
    "dgc_exact_counts": "ptr x, " + _GEOM + "i32 vec",
    "dgc_write": "ptr x, " + _GEOM + "i32 vec, i64 k, ptr values, ptr indices",
}
# every launch after the first starts while the one before still runs (dgc_select.cu)
_KERNELS = {
    name: Kernel(_SOURCE, name, params, after_previous=name != "dgc_sample_hist")
    for name, params in _PARAMS.items()
}


class _Workspace:
    """One buffer (its first _ZEROED_BYTES zero), its launch geometry and kernels, for (device,
    stream, n, m, nthr, cap)."""

    __slots__ = ("buf", "fast", "fns", "geom", "grids")

    def __init__(
        self, dev: torch.device, n: int, m: int, nthr: int, cap: int, resample: bool
    ) -> None:
        tiles = -(-n // _TILE)
        nbytes = _workspace_bytes(m, tiles, nthr, cap)
        # zeroed once: every call leaves its counters, histograms and totals zero again
        self.buf = torch.empty(-(-nbytes // 8), dtype=torch.int64, device=dev)
        self.buf[: _ZEROED_BYTES // 8].zero_()
        sms = _cuda.num_sms(_cuda.device_index())
        self.geom = (self.buf.data_ptr(), n, m, tiles, nthr, cap)
        self.grids = (
            max(1, min(-(-m // (4 * _BLOCK)), 4 * sms)),  # sample_hist: 4 gathers per thread
            max(1, min(-(-m // _BLOCK), 4 * sms)),  # sample_finish
            min(tiles, 4 * sms),  # exact_hist, exact_counts: tiles in a grid stride
            -(-tiles // _WCHUNK),  # write
            min(tiles, _DEFINES["FAST_BLOCKS"] * sms),  # count_fast
            min(tiles, 3 * sms),  # count_reg, count_search: their launch bounds
        )
        count = "dgc_count_reg" if nthr <= _NREG else "dgc_count_search"
        # resample mode counts the loop's first _NFAST states, then (gated on the device) all
        self.fast = resample and nthr > NFAST
        names = ("dgc_sample_hist", "dgc_sample_finish", "dgc_exact_hist", "dgc_exact_counts")
        self.fns = {name: _KERNELS[name] for name in (*names, "dgc_write")}
        self.fns["count"] = _KERNELS[count]
        self.fns["count_fast"] = _KERNELS["dgc_count_fast"]


# Workspaces are kept per (device, stream, n, num_samples, thresholds, capacity): a DGC hook
# calls the op with the same sizes every step, and two streams never share one (the kernels
# keep counters in it). At most _WS_KEEP of them; the least recently used is dropped first.
# A call captured into a CUDA graph gets a workspace of its own, its zeroing captured with it:
# graphs captured on one stream may be replayed on several at once.
_WS_KEEP = 64
_workspaces: OrderedDict[tuple, _Workspace] = OrderedDict()
_ws_lock = threading.Lock()


def _workspace(
    dev: torch.device, n: int, m: int, nthr: int, cap: int, resample: bool
) -> _Workspace:
    if torch.cuda.is_current_stream_capturing():
        return _Workspace(dev, n, m, nthr, cap, resample)
    key = (dev.index, _cuda.raw_stream(dev.index), n, m, nthr, cap, resample)
    with _ws_lock:
        ws = _workspaces.get(key)
        if ws is not None:
            _workspaces.move_to_end(key)
            return ws
    ws = _Workspace(dev, n, m, nthr, cap, resample)
    with _ws_lock:
        _workspaces[key] = ws
        while len(_workspaces) > _WS_KEEP:
            _workspaces.popitem(last=False)
    return ws


def launch_select(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of checked, fp32, CUDA ``x`` with ``k >= 1``; ``args`` are the op's,
    in its schema's order (``m``: ``num_samples``)."""
    x, k, m, sample_start, sample_stride, sample_indices, upper, lower, iters, resample = args
    n = x.numel()
    dev = x.device
    tiles = -(-n // _TILE)
    nthr = iters + 1 if resample else (iters + 1) * (iters + 2) // 2
    # every slot is written by dgc_write: the selected entries, then the (-1, 0) padding
    values = torch.empty(k, dtype=x.dtype, device=dev)
    indices = torch.empty(k, dtype=torch.int64, device=dev)
    if sample_indices is not None:
        sample_indices = sample_indices.contiguous()
    px = x.data_ptr()
    vec = 1 if px % 16 == 0 else 0  # float4 loads need 16-byte alignment
    ks = min(m, max(1, (m * k + n - 1) // n))
    loop = (upper, lower, iters, 1 if resample else 0)
    with _cuda.on_device(dev):
        ws = _workspace(dev, n, m, nthr, _capacity(k, tiles), resample)
        f, geom, (g_hist, g_finish, g_tiles, g_write, g_fast, g_count) = ws.fns, ws.geom, ws.grids
        sidx = 0 if sample_indices is None else sample_indices.data_ptr()
        f["dgc_sample_hist"](g_hist, _BLOCK, px, sidx, *geom, sample_start, sample_stride, ks)
        f["dgc_sample_finish"](g_finish, _BLOCK, *geom, *loop)
        if ws.fast:  # the loop's first states; all of them only when it needs more
            f["count_fast"](g_fast, _BLOCK, px, *geom, vec, k, *loop)
            f["count"](g_count, _BLOCK, px, *geom, vec, k, *loop, 1)
        else:
            f["count"](g_count, _BLOCK, px, *geom, vec, k, *loop, 0)
        if resample and iters > 0:  # exact top-k after a resample stop, gated on the device
            for digit in range(3):
                f["dgc_exact_hist"](g_tiles, _BLOCK, px, *geom, vec, digit)
            f["dgc_exact_counts"](g_tiles, _BLOCK, px, *geom, vec)
        f["dgc_write"](g_write, _BLOCK, px, *geom, vec, k, values.data_ptr(), indices.data_ptr())
    return values, indices
