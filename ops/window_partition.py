"""Swin's shift + window partition and its inverse, one gather kernel each way.

``aiak::roll_window_partition(x, window, shift)``: ``torch.roll(x, (-shift, -shift), (1, 2))``
followed by the window partition, ``[B, H, W, C]`` -> ``[B*nW, window*window, C]``;
``aiak::window_merge_roll(windows, H, W, shift)`` is its inverse. Each is the other's
gradient. The kernel copies whole token rows in 16/8/4/2/1-byte words, for any float dtype.
"""

from __future__ import annotations

import math

import torch

from aiak.ops import _cuda
from aiak.ops import _window_attention_cuda as _wac
from aiak.ops._args import check_int
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._driver import Kernel
from aiak.ops._registry import define
from aiak.ops._window_attention_cuda import SOURCE
from aiak.ops._window_attention_ref import FLOATS

__all__ = ["roll_window_partition", "window_merge_roll"]

PARTITION = declare(Capability("roll_window_partition", dtypes=FLOATS))
# one gather per word size in bytes: whole token rows move in 16/8/4/2/1-byte words
_GATHER = {
    unit: Kernel(
        SOURCE,
        f"window_gather_{unit}",
        "ptr src, ptr dst, i32 H, i32 W, i32 ws, i32 sh, i32 sw, i64 units, i64 total, i32 merge",
    )
    for unit in (16, 8, 4, 2, 1)
}


def _window_size(windows: torch.Tensor) -> int:
    area = windows.shape[1]
    ws = math.isqrt(area)
    if ws * ws != area or ws == 0:
        raise ValueError(
            f"window_merge_roll: windows must be [B*nW, ws*ws, C]; {area} tokens is not a square"
        )
    return ws


def _check_partition(x: torch.Tensor, window: int, shift: int) -> None:
    op = "roll_window_partition"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be [B, H, W, C], got shape {tuple(x.shape)}")
    _check_geometry(op, x.shape[1], x.shape[2], window, shift)


def _check_geometry(op: str, h: int, w: int, window: int, shift: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"{op}: window must be a positive int, got {window!r}")
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"{op}: shift must be a non-negative int, got {shift!r}")
    if h % window or w % window:
        raise ValueError(f"{op}: H = {h} and W = {w} must be multiples of window = {window}")


def _check_merge(windows: torch.Tensor, h: int, w: int, shift: int) -> int:
    op = "window_merge_roll"
    if not isinstance(windows, torch.Tensor):
        raise TypeError(f"{op}: windows must be a Tensor, got {type(windows).__name__}")
    if windows.dim() != 3:
        raise ValueError(f"{op}: windows must be [B*nW, ws*ws, C], got {tuple(windows.shape)}")
    ws = _window_size(windows)
    _check_geometry(op, h, w, ws, shift)
    per_image = (h // ws) * (w // ws)
    if windows.shape[0] % per_image:
        raise ValueError(
            f"{op}: windows has {windows.shape[0]} windows, not a multiple of the "
            f"{per_image} windows of an {h}x{w} image"
        )
    return ws


def _partition_reference(x: torch.Tensor, window: int, shift: int) -> torch.Tensor:
    _check_partition(x, window, shift)
    b, h, w, c = x.shape
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    x = x.reshape(b, h // window, window, w // window, window, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, c).clone()


def _merge_reference(windows: torch.Tensor, h: int, w: int, shift: int) -> torch.Tensor:
    ws = _check_merge(windows, h, w, shift)
    c = windows.shape[2]
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.reshape(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, h, w, c)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x.clone()


def _gather_cuda(
    src: torch.Tensor, dst: torch.Tensor, h: int, w: int, ws: int, shift: int, merge: bool
) -> None:
    if dst.numel() == 0:
        return
    ptrs = src.data_ptr() | dst.data_ptr()
    key = (src.shape, dst.numel(), src.dtype, h, w, ws, shift, merge, ptrs & 15)
    with _cuda.on_device(src.device):
        device = torch.cuda.current_device()
        plan = _GATHERS.get((*key, device))
        if plan is None:
            row = src.shape[-1] * src.element_size()  # bytes per token
            unit = next(u for u in (16, 8, 4, 2, 1) if row % u == 0 and ptrs % u == 0)
            total = dst.numel() * dst.element_size() // unit
            blocks = max(1, min(-(-total // 256), 32 * _cuda.num_sms(device)))
            tail = (h, w, ws, shift % h, shift % w, row // unit, total, int(merge))
            plan = _GATHERS[(*key, device)] = (_GATHER[unit], blocks, tail)
        kernel, blocks, tail = plan
        kernel(blocks, 256, src, dst, *tail)


# (src shape, dst numel, dtype, geometry, direction, pointer bits, device) -> launch plan
_GATHERS: dict[tuple, tuple] = {}


def _partition_cuda(x: torch.Tensor, window: int, shift: int) -> torch.Tensor:
    _check_partition(x, window, shift)
    if not use_kernel(PARTITION, x.device, (x.dtype,)):
        return _partition_reference(x, window, shift)
    b, h, w, c = x.shape
    x = x.contiguous()
    out = torch.empty(
        (b * (h // window) * (w // window), window * window, c), dtype=x.dtype, device=x.device
    )
    _gather_cuda(x, out, h, w, window, shift, merge=False)
    return out


def _merge_cuda(windows: torch.Tensor, h: int, w: int, shift: int) -> torch.Tensor:
    ws = _check_merge(windows, h, w, shift)
    if not use_kernel(PARTITION, windows.device, (windows.dtype,)):
        return _merge_reference(windows, h, w, shift)
    windows = windows.contiguous()
    c = windows.shape[2]
    b = windows.shape[0] // ((h // ws) * (w // ws))
    out = torch.empty((b, h, w, c), dtype=windows.dtype, device=windows.device)
    _gather_cuda(windows, out, h, w, ws, shift, merge=True)
    return out


def _partition_fake(x, window, shift):
    _check_partition(x, window, shift)
    b, h, w, c = x.shape
    return x.new_empty((b * (h // window) * (w // window), window * window, c))


def _merge_fake(windows, h, w, shift):
    ws = _check_merge(windows, h, w, shift)
    b = windows.shape[0] // ((h // ws) * (w // ws))
    return windows.new_empty((b, h, w, windows.shape[2]))


PARTITION_OP = define(
    "roll_window_partition(Tensor x, int window, int shift) -> Tensor",
    _partition_reference,
    cuda=_partition_cuda,
    fake=_partition_fake,
    differentiable=True,
)
MERGE_OP = define(
    "window_merge_roll(Tensor windows, int H, int W, int shift) -> Tensor",
    _merge_reference,
    cuda=_merge_cuda,
    fake=_merge_fake,
    differentiable=True,
)


# The autograd formulas, written once (each op's gradient is the other op): the registered
# ops run them through the dispatcher, the eager path (below) with the CUDA kernels called
# directly.


def _partition_setup(ctx, inputs, output) -> None:
    x, _, shift = inputs
    ctx.hw = (x.shape[1], x.shape[2])
    ctx.shift = shift


def _partition_grads(ctx, grad, merge):
    return merge(grad.contiguous(), *ctx.hw, ctx.shift), None, None


def _partition_backward(ctx, grad):
    return _partition_grads(ctx, grad, torch.ops.aiak.window_merge_roll)


def _merge_setup(ctx, inputs, output) -> None:
    windows, _, _, shift = inputs
    ctx.window = _window_size(windows)
    ctx.shift = shift


def _merge_grads(ctx, grad, partition):
    return partition(grad.contiguous(), ctx.window, ctx.shift), None, None, None


def _merge_backward(ctx, grad):
    return _merge_grads(ctx, grad, torch.ops.aiak.roll_window_partition)


torch.library.register_autograd(
    "aiak::roll_window_partition", _partition_backward, setup_context=_partition_setup
)
torch.library.register_autograd(
    "aiak::window_merge_roll", _merge_backward, setup_context=_merge_setup
)


class _EagerPartition(torch.autograd.Function):
    """The op's formula with the gathers launched directly (the eager path; see
    ``window_attention._EagerAttention``)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _partition_cuda(*inputs)
        _partition_setup(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _partition_grads(ctx, grad, _merge_cuda)


class _EagerMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        out = _merge_cuda(*inputs)
        _merge_setup(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _merge_grads(ctx, grad, _partition_cuda)


def roll_window_partition(x: torch.Tensor, window: int, shift: int = 0) -> torch.Tensor:
    """``[B, H, W, C]`` -> ``[B*nW, window*window, C]``: ``torch.roll`` by ``-shift`` on H and W,
    then Swin's window partition, in one gather."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"roll_window_partition: x must be a Tensor, got {type(x).__name__}")
    _check_geometry("roll_window_partition", 1, 1, 1, shift)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"roll_window_partition: window must be a positive int, got {window!r}")
    if _wac.eager(x):
        return _EagerPartition.apply(x, window, shift)
    return PARTITION_OP(x, window, shift)


def window_merge_roll(windows: torch.Tensor, H: int, W: int, shift: int = 0) -> torch.Tensor:
    """The inverse of :func:`roll_window_partition`: windows back to ``[B, H, W, C]``, then
    ``torch.roll`` by ``+shift``."""
    if not isinstance(windows, torch.Tensor):
        raise TypeError(
            f"window_merge_roll: windows must be a Tensor, got {type(windows).__name__}"
        )
    _check_geometry("window_merge_roll", 1, 1, 1, shift)
    for name, v in (("H", H), ("W", W)):
        check_int(name, v, ge=1, op="window_merge_roll")
    if _wac.eager(windows):
        return _EagerMerge.apply(windows, H, W, shift)
    return MERGE_OP(windows, H, W, shift)
