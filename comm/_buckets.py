"""Bucket views: what an inner hook is handed instead of DDP's own ``GradBucket``.

A :class:`SubBucket` is a buffer with per-parameter views into it; :func:`rebase` re-makes a
bucket's layout over a cast copy, :func:`shard_views` cuts one rank's shard of a bucket into
row-aligned views (what ``hierarchical`` hands its outer hook).
"""

from __future__ import annotations

from typing import Any

import torch

from ._collectives import Batch

__all__ = ["SubBucket", "rebase", "shard_views"]


class SubBucket:
    """A bucket-like view handed to an inner hook: a buffer and per-parameter views into it.

    Real :class:`torch.distributed.GradBucket` objects cannot be built from Python; inner
    hooks only call ``buffer``, ``gradients``, ``parameters``, ``index`` and ``is_last``.
    ``views=None``: the parent's layout over ``buffer``, made on the first ``gradients()``
    call (most hooks never make it: list building per bucket is host time on DDP's critical
    path); parameters likewise come from the parent when asked for.
    """

    __slots__ = (
        "_buffer",
        "_index",
        "_is_last",
        "_params",
        "_parent",
        "_views",
        "batch",
        "step",
        "wire_ok",
    )

    def __init__(
        self,
        buffer: torch.Tensor,
        views: list[torch.Tensor] | None,
        parent: Any,
        params: list[torch.Tensor] | None = None,
        step: int | None = None,
    ) -> None:
        # ``step``: the top-level hook's step number, so inner hooks decide per step alike on
        # every rank even when they run in callbacks.
        self._buffer = buffer
        self._views = views
        self._parent = parent
        self._params = params
        # the top-level hook's Batch when it coalesces buckets (leaf allreduces hold there)
        self.batch: Batch | None
        # True only for the bucket DDP handed to the top-level hook (never inherited): its
        # future may carry the averaged wire tensor itself, narrower but of the same length,
        # because DDP copies the result into the gradients with a cast (see cast.Cast.reduce).
        self.wire_ok = False
        if type(parent) is SubBucket:  # fields, not calls: host time per bucket
            self.step = parent.step if step is None else step
            self.batch, self._index, self._is_last = parent.batch, parent._index, parent._is_last
        else:
            self.step = step if step is not None else getattr(parent, "step", 0)
            self.batch = getattr(parent, "batch", None)
            self._index = parent.index()
            self._is_last = parent.is_last()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        if self._views is None:
            src = self._parent.buffer()
            views = self._parent.gradients()
            if self._buffer.data_ptr() != src.data_ptr():
                views = _mirror(views, src, self._buffer)
            self._views = views
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        if self._params is None:
            self._params = list(self._parent.parameters())
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buffer = t


def _mirror(views: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> list[torch.Tensor]:
    """``views`` of ``src`` re-made over ``dst`` (same length): same offsets, sizes and strides
    (DDP's bucket views keep each parameter's strides, channels_last included)."""
    base = dst.storage_offset() - src.storage_offset()
    return [dst.as_strided(v.size(), v.stride(), v.storage_offset() + base) for v in views]


def rebase(bucket: Any, buffer: torch.Tensor) -> SubBucket:
    """The same layout as ``bucket`` over another buffer of the same length (a cast copy)."""
    return SubBucket(buffer, None, bucket, step=getattr(bucket, "step", None))


def shard_views(bucket: Any, start: int, shard: torch.Tensor) -> SubBucket:
    """Views of ``shard`` (elements ``[start, start+len)`` of the bucket) cut along rows.

    Each parameter's part of the shard is split into a partial first row, whole rows (a 2-D
    view a layer-wise compressor such as PowerSGD can factorise) and a partial last row; the
    padding past the bucket's end is one more 1-D view, so the views cover the shard exactly.
    """
    end = start + shard.numel()
    views: list[torch.Tensor] = []

    def piece(a: int, b: int) -> None:  # absolute bucket offsets -> 1-D view of the shard
        if b > a:
            views.append(shard[a - start : b - start])

    off = 0
    for g in bucket.gradients():
        n = g.numel()
        lo, hi = max(off, start), min(off + n, end)
        if lo < hi:
            cols = n // g.shape[0] if g.dim() > 0 and g.shape[0] > 0 else 1
            r0, r1 = -(-(lo - off) // cols), (hi - off) // cols
            if r1 > r0:
                piece(lo, off + r0 * cols)
                body = shard[off + r0 * cols - start : off + r1 * cols - start]
                views.append(body.view(r1 - r0, cols))
                piece(off + r1 * cols, hi)
            else:
                piece(lo, hi)
        off += n
    piece(max(off, start), end)
    return SubBucket(shard, views, bucket)
