"""The CUDA launcher of ``aiak::dgc_segments_select`` (ops/dgc_segments.py holds the checks,
the reference and the op): fp32 ``x``, a fixed number of launches of
ops/kernels/dgc_segments.cu whatever the number of segments (:func:`launches_per_call`), a
workspace allocated once per (device, stream, segments, tiles) and reused, and per plan a small
device table of block prefixes built once.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from typing import Any

import torch

from aiak.ops import _cuda
from aiak.ops._driver import Kernel

_SOURCE = "dgc_segments.cu"
_DEFINES = _cuda.defines(_SOURCE)
_BLOCK = _DEFINES["BLOCK"]
_TILE = _DEFINES["TILE"]  # elements of one segment per block of the tile passes
_SAMP = _DEFINES["SAMP"]  # sample slots of one segment per block of the sample histogram
_SW = _DEFINES["SW"]  # state words per segment
_BINS = _DEFINES["BINS"]

_WS = "ptr ws, i32 S, i64 T"
_TILES = "ptr x, ptr table, ptr aux, " + _WS
_PARAMS = {
    "dgc_seg_init": "ptr table, ptr sample_start, " + _WS + ", i32 iters",
    "dgc_seg_sample_hist": "ptr x, ptr sidx, ptr table, ptr aux, " + _WS + ", i64 N, i32 digit",
    "dgc_seg_pick": "ptr table, " + _WS + ", i32 stage, i32 digit, i32 iters",
    "dgc_seg_count": _TILES,
    "dgc_seg_decide": "ptr table, "
    + _WS
    + ", f64 upper, f64 lower, f32 up32, f32 low32, i32 resample",
    "dgc_seg_exact_hist": _TILES + ", i32 digit",
    "dgc_seg_tile_counts": _TILES,
    "dgc_seg_scan": "ptr table, ptr aux, " + _WS + ", ptr values, ptr indices",
    "dgc_seg_write": _TILES + ", ptr values, ptr indices",
}
# every launch after init may start while the one before still runs (dgc_segments.cu)
_K = {
    name: Kernel(_SOURCE, name, params, after_previous=name != "dgc_seg_init")
    for name, params in _PARAMS.items()
}


def launches_per_call(iters: int, resample: bool) -> int:
    """Kernel launches of one CUDA call, whatever the number of segments: init, 4 x (sample
    histogram + pick), ``iters`` x (count + decide), with ``resample`` (and ``iters > 0``)
    4 x (exact histogram + pick), then tile counts, scan and write."""
    return 1 + 8 + 2 * iters + (8 if resample and iters > 0 else 0) + 3


def _prefix(sizes: list[int]) -> list[int]:
    out = [0]
    for v in sizes:
        out.append(out[-1] + v)
    return out


def _aux(plan: Any, dev: torch.device) -> tuple[torch.Tensor, int, int, int]:
    """(device table of block prefixes, tiles, strided sample blocks, uniform sample blocks) of
    a plan: [0, S] tiles, [S+1, 2S+1] strided sample blocks, [2S+2, 3S+2] uniform ones. Built
    once per plan and device (a host-to-device copy: warm up before a CUDA graph capture)."""
    key = ("aux", dev)
    hit = plan.cache.get(key)
    if hit is not None:
        return hit
    tiles, strided, uniform = [], [], []
    for _, n, _, _, m, _, _, _ in plan.rows:
        tiles.append(-(-n // _TILE))
        strided.append(-(-(n if m == n else m + 1) // _SAMP))  # m or m + 1 strided samples
        uniform.append(-(-m // _SAMP))
    words = _prefix(tiles) + _prefix(strided) + _prefix(uniform)
    aux = torch.tensor(words, dtype=torch.int64).to(dev)
    hit = plan.cache[key] = (aux, sum(tiles), sum(strided), sum(uniform))
    return hit


# Workspaces are kept per (device, stream, segments, tiles): a DGC hook calls the op with the
# same buckets every step, and two streams never share one. At most _WS_KEEP of them; the least
# recently used is dropped first. A call captured into a CUDA graph gets a workspace of its own.
_WS_KEEP = 64
_workspaces: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_ws_lock = threading.Lock()


def _workspace(dev: torch.device, S: int, T: int) -> torch.Tensor:
    words = S * (_SW + _BINS) + 4 * T  # the layout of `carve` in dgc_segments.cu
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(words, dtype=torch.int64, device=dev)
    key = (dev.index, _cuda.raw_stream(dev.index), S, T)
    with _ws_lock:
        ws = _workspaces.get(key)
        if ws is not None:
            _workspaces.move_to_end(key)
            return ws
    ws = torch.empty(words, dtype=torch.int64, device=dev)  # init rewrites what a call reads
    with _ws_lock:
        _workspaces[key] = ws
        while len(_workspaces) > _WS_KEEP:
            _workspaces.popitem(last=False)
    return ws


def _fp32(v: float) -> float:
    """``v`` rounded to fp32 (to nearest; the checks keep ``upper`` below fp32's maximum)."""
    return _F32.unpack(_F32.pack(v))[0]


_F32 = struct.Struct("@f")


def launch_segments(args: tuple, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of checked, fp32, CUDA ``x`` with at least one segment; ``args``
    are the op's in its schema's order, ``plan`` the table's host plan."""
    x, table, sample_start, sidx, upper, lower, iters, resample = args
    dev = x.device
    S = len(plan.rows)
    values = torch.empty(plan.K, dtype=torch.float32, device=dev)
    indices = torch.empty(plan.K, dtype=torch.int64, device=dev)
    table = table.contiguous()
    sample_start = sample_start.contiguous()
    if sidx is not None:
        sidx = sidx.contiguous()
    with _cuda.on_device(dev):
        aux, T, sb_strided, sb_uniform = _aux(plan, dev)
        ws = _workspace(dev, S, T)
        k = _K
        tiles = (x, table, aux, ws, S, T)
        k["dgc_seg_init"](S, _BLOCK, table, sample_start, ws, S, T, iters)
        sblocks = sb_strided if sidx is None else sb_uniform
        for digit in range(4):
            k["dgc_seg_sample_hist"](
                sblocks, _BLOCK, x, sidx, table, aux, ws, S, T, x.numel(), digit
            )
            k["dgc_seg_pick"](S, _BLOCK, table, ws, S, T, 0, digit, iters)
        if iters > 0:
            segs = -(-S // _BLOCK)
            scale = (upper, lower, _fp32(upper), _fp32(lower), int(resample))
            for _ in range(iters):
                k["dgc_seg_count"](T, _BLOCK, *tiles)
                k["dgc_seg_decide"](segs, _BLOCK, table, ws, S, T, *scale)
            if resample:  # the exact top-k of segments stopped by a resample, gated on the device
                for digit in range(4):
                    k["dgc_seg_exact_hist"](T, _BLOCK, *tiles, digit)
                    k["dgc_seg_pick"](S, _BLOCK, table, ws, S, T, 1, digit, iters)
        k["dgc_seg_tile_counts"](T, _BLOCK, *tiles)
        k["dgc_seg_scan"](S, _BLOCK, table, aux, ws, S, T, values, indices)
        k["dgc_seg_write"](T, _BLOCK, *tiles, values, indices)
    return values, indices
