"""The CUDA launcher of ``aiak::simota_assign`` (ops/simota.py holds the checks, the reference
and the op): three launches of ops/kernels/simota.cu on float32 inputs, with a torch-allocated
workspace; nothing waits for the GPU. The kernels clear a device flag where a valid gt has a
class id outside ``[0, C)`` or a negative size, or an anchor stride is negative; a device-side
assert on that flag makes those an error without a host synchronisation.
"""

from __future__ import annotations

import torch

from aiak.ops import _cuda
from aiak.ops._driver import Kernel

_SOURCE = "simota.cu"
# --fmad=false: products and sums round one by one, as in the reference (no contraction).
_OPTIONS = ("-std=c++17", "--fmad=false")
_BLOCK = 256
_GTS = "ptr gt_boxes, ptr gt_cls, ptr gt_valid, ptr centers, ptr strides, "
_DIMS = "i32 B, i32 G, i32 A, i32 C, f64 radius, i32 center_only, "
_PREPARE = Kernel(
    _SOURCE,
    "simota_prepare",
    _GTS + "ptr cls_logits, ptr obj_logits, ptr cand, ptr bg_sum, ptr count, ptr owner, "
    "ptr num_fg, " + _DIMS + "i32 xyxy, ptr ok",
    options=_OPTIONS,
)
_SELECT = Kernel(
    _SOURCE,
    "simota_select",
    _GTS + "ptr pred, ptr cls_logits, ptr obj_logits, ptr cand, ptr bg_sum, ptr count, "
    "ptr owner, " + _DIMS + "i32 penalty, i32 xyxy, ptr ok",
    options=_OPTIONS,
)
_RESOLVE = Kernel(
    _SOURCE,
    "simota_resolve",
    _GTS + "ptr pred, ptr cls_logits, ptr obj_logits, ptr bg_sum, ptr count, ptr owner, "
    "ptr fg_mask, ptr matched_gt, ptr matched_iou, ptr num_fg, " + _DIMS + "i32 penalty, i32 xyxy",
    options=_OPTIONS,
)
_WARPS = _BLOCK // 32
VALUE_ERROR = (
    "simota_assign: a valid gt has a class id outside [0, C), a negative width or height, or an "
    "anchor stride is negative"
)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def launch_simota(
    args: tuple[torch.Tensor, ...],
    sizes: tuple[int, int, int, int],
    center_radius: float,
    center_only: bool,
    geometry_penalty: bool,
    box_format: str,
) -> tuple[torch.Tensor, ...]:
    """``(fg_mask, matched_gt, matched_iou, num_fg)`` of checked CUDA ``args`` (the op's eight
    tensors in schema order) of sizes ``(B, G, A, C)``."""
    gt_boxes, gt_classes, gt_valid, anchor_centers, anchor_strides, pred_boxes = args[:6]
    cls_logits, obj_logits = args[6:]
    B, G, A, C = sizes
    device = gt_boxes.device
    fg_mask = torch.empty(B, A, dtype=torch.bool, device=device)
    matched_gt = torch.empty(B, A, dtype=torch.int64, device=device)
    matched_iou = torch.empty(B, A, dtype=torch.float32, device=device)
    num_fg = torch.empty(B, dtype=torch.int64, device=device)
    out = (fg_mask, matched_gt, matched_iou, num_fg)
    if B == 0 or A == 0:
        num_fg.zero_()
        return out
    boxes, pred = _f32(gt_boxes), _f32(pred_boxes)
    cls, obj = _f32(cls_logits), _f32(obj_logits)
    centers, strides = _f32(anchor_centers), _f32(anchor_strides)
    classes = gt_classes.to(torch.int64).contiguous()
    valid = gt_valid.contiguous()
    cand = torch.empty(B, A, dtype=torch.uint8, device=device)
    bg_sum = torch.empty(B, A, dtype=torch.float64, device=device)
    count = torch.empty(B, A, dtype=torch.int32, device=device)
    owner = torch.empty(B, A, dtype=torch.int32, device=device)
    ok = torch.ones(1, dtype=torch.bool, device=device)  # the kernels clear it on bad values
    # int32 sizes and flags, the radius in float64 (the kernels' parameter types)
    dims = (B, G, A, C, center_radius)
    flags = (int(center_only), int(geometry_penalty), int(box_format == "xyxy"))
    gts = (boxes, classes, valid, centers, strides)
    with _cuda.on_device(device):
        _PREPARE(
            (-(-A // _WARPS), B), _BLOCK,
            *gts, cls, obj, cand, bg_sum, count, owner, num_fg, *dims, flags[0], flags[2], ok,
        )  # fmt: skip
        if G:
            _SELECT(
                B * G, _BLOCK, *gts, pred, cls, obj, cand, bg_sum, count, owner, *dims, *flags, ok
            )  # fmt: skip
        _RESOLVE(
            (-(-A // _BLOCK), B), _BLOCK,
            *gts, pred, cls, obj, bg_sum, count, owner, fg_mask, matched_gt, matched_iou,
            num_fg, *dims, *flags,
        )  # fmt: skip
    torch._assert_async(ok, VALUE_ERROR)
    return out
