"""``aiak::simota_assign``: SimOTA label assignment for a whole batch, no host synchronisation.

YOLOX's ``get_assignments`` (and YOLOv7's ``build_targets``, the same core) runs once per image
in a Python loop, with a ``.item()`` or ``.tolist()`` per image; this op takes the batch with
padded gts and returns dense outputs, so nothing waits for the GPU.

Semantics, per image and over its *usable* gts (``gt_valid`` and a class id in ``[0, C)``):

- candidates: anchors inside some usable gt's box or its centre square of half-side
  ``center_radius * stride`` (YOLOX classic, radius 2.5); with ``center_only`` the centre
  square alone (newer YOLOX, radius 1.5). Only candidates are ever matched.
- IoU of each (gt, candidate) pair against the predicted box; ``iou_cost = -log(iou + 1e-8)``.
- ``cls_cost = sum_c BCE(sqrt(sigmoid(cls_c) * sigmoid(obj)), onehot(gt class))``, each log
  clamped at -100 as ``torch.nn.functional.binary_cross_entropy`` does.
- ``cost = cls_cost + 3 * iou_cost`` plus, with ``geometry_penalty``, 1e5 where the anchor is not
  in both the box and the centre square (classic) or 1e6 where it is outside the centre square
  (``center_only``); without it, the YOLOv7 cost.
- ``dyn_k = max(1, int(sum of the 10 largest candidate IoUs))``; each gt takes its ``dyn_k``
  lowest-cost candidates; an anchor taken by several gts goes to the usable gt of lowest cost at
  that anchor (over all usable gts, as YOLOX's ``torch.min(cost[:, multiple], 0)``).

Ties are broken by index, the lowest first: among equal costs the lower anchor index is taken
first, and an anchor taken twice goes to the lowest gt index among equal costs. (``torch.topk``
leaves the order of ties unspecified.)

IoU and cost are computed in float64 from the (fp32) inputs: in fp32 the 1e5 penalty rounds
``1e5 + cost`` to steps of 1/128, so YOLOX's own ranking of out-of-geometry anchors is mostly
ties that topk breaks arbitrarily; in float64 the ranking follows the real costs, and the kernel
and this reference agree on it (both compute every product and sum in the same order). NaN
costs sort after every number; a NaN IoU counts as 0.

Boxes (gts and predictions alike) are ``cxcywh`` (YOLOX) or ``xyxy``. A valid gt whose class id
is outside ``[0, C)`` or whose width or height is negative, and a negative anchor stride, are
errors on every device: ``ValueError`` on CPU tensors; on CUDA a device-side assert (raised at
the next synchronisation, as torch's own out-of-range indexing does), because a host-side
check would synchronise the host. The kernel never reads such a gt's class row.

Read top-down: checks, the PyTorch reference (the default kernel on every device), the CUDA
dispatch (its launcher is ops/_simota_cuda.py), the op declaration, the public function.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from aiak.ops._capability import FLOAT_DTYPES, Capability, declare, use_kernel
from aiak.ops._registry import define
from aiak.ops._simota_cuda import VALUE_ERROR, launch_simota

__all__ = ["SimOTAAssignment", "simota_assign"]

SIMOTA = declare(Capability("simota_assign"))
_TOPK = 10
_FLOAT_MAX = sys.float_info.max
_FORMATS = ("cxcywh", "xyxy")
_INT_DTYPES = (torch.int64, torch.int32)


class SimOTAAssignment(NamedTuple):
    """Dense outputs: ``fg_mask`` [B, A] bool, ``matched_gt`` [B, A] int64 (-1: background),
    ``matched_iou`` [B, A] float32 (0 for background), ``num_fg`` [B] int64."""

    fg_mask: torch.Tensor
    matched_gt: torch.Tensor
    matched_iou: torch.Tensor
    num_fg: torch.Tensor


_NAMES = (
    "gt_boxes",
    "gt_classes",
    "gt_valid",
    "anchor_centers",
    "anchor_strides",
    "pred_boxes",
    "cls_logits",
    "obj_logits",
)
# the schema's center_radius, center_only, geometry_penalty and box_format: the dispatcher
# leaves out trailing arguments equal to their defaults
_DEFAULTS = (2.5, False, True, "cxcywh")


def _check(
    tensors: tuple[torch.Tensor, ...], center_radius: float, box_format: str
) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of the 8 tensors (``_NAMES``); returns (B, G, A, C). Shared by
    reference, kernel and fake."""
    op = "simota_assign"
    named = tuple(zip(_NAMES, tensors))
    gt_boxes, gt_classes, gt_valid, anchor_centers, anchor_strides, pred_boxes = tensors[:6]
    cls_logits, obj_logits = tensors[6:]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if name == "gt_classes":
            ok = t.dtype in _INT_DTYPES
        elif name == "gt_valid":
            ok = t.dtype == torch.bool
        else:
            ok = t.dtype in FLOAT_DTYPES
        if not ok:
            want = {"gt_classes": "int64 or int32", "gt_valid": "bool"}.get(
                name, "float32, float16 or bfloat16"
            )
            raise TypeError(f"{op}: {name} has dtype {t.dtype}, expected {want}")
    if gt_boxes.dim() != 3 or gt_boxes.shape[-1] != 4:
        raise ValueError(f"{op}: gt_boxes must be [B, G, 4], got {tuple(gt_boxes.shape)}")
    B, G = gt_boxes.shape[:2]
    for name, t in (("gt_classes", gt_classes), ("gt_valid", gt_valid)):
        if tuple(t.shape) != (B, G):
            raise ValueError(f"{op}: {name} must be [B, G] = [{B}, {G}], got {tuple(t.shape)}")
    if anchor_centers.dim() != 2 or anchor_centers.shape[-1] != 2:
        raise ValueError(f"{op}: anchor_centers must be [A, 2], got {tuple(anchor_centers.shape)}")
    A = anchor_centers.shape[0]
    if tuple(anchor_strides.shape) != (A,):
        raise ValueError(
            f"{op}: anchor_strides must be [A] = [{A}], got {tuple(anchor_strides.shape)}"
        )
    if tuple(pred_boxes.shape) != (B, A, 4):
        raise ValueError(
            f"{op}: pred_boxes must be [B, A, 4] = [{B}, {A}, 4], got {tuple(pred_boxes.shape)}"
        )
    if cls_logits.dim() != 3 or tuple(cls_logits.shape[:2]) != (B, A) or cls_logits.shape[2] < 1:
        raise ValueError(
            f"{op}: cls_logits must be [B, A, C] = [{B}, {A}, C >= 1], "
            f"got {tuple(cls_logits.shape)}"
        )
    if tuple(obj_logits.shape) not in ((B, A), (B, A, 1)):
        raise ValueError(
            f"{op}: obj_logits must be [B, A] or [B, A, 1] = [{B}, {A}], "
            f"got {tuple(obj_logits.shape)}"
        )
    device = gt_boxes.device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but gt_boxes is on {device}")
    if isinstance(center_radius, bool) or not isinstance(center_radius, (int, float)):
        raise TypeError(f"{op}: center_radius must be a number, got {type(center_radius).__name__}")
    if not 0 < center_radius <= _FLOAT_MAX:  # NaN, inf and ints beyond a float fail
        raise ValueError(f"{op}: center_radius must be positive and finite, got {center_radius}")
    if box_format not in _FORMATS:
        raise ValueError(f"{op}: box_format must be one of {_FORMATS}, got {box_format!r}")
    C = cls_logits.shape[2]
    if max(A, B * A, G) >= 2**31 or B > 65535:
        raise ValueError(f"{op}: sizes B={B}, A={A}, G={G} are beyond the kernel's grid")
    return B, G, A, C


def _check_values(
    gt_boxes: torch.Tensor,
    gt_classes: torch.Tensor,
    gt_valid: torch.Tensor,
    anchor_strides: torch.Tensor,
    C: int,
    xyxy: bool,
) -> None:
    """The rules on values, one on every device: on CPU a ``ValueError`` naming the argument;
    on CUDA a device-side assert (``torch._assert_async``, as torch's own indexing does), which
    never synchronises the host. Padded gts (``gt_valid`` False) may hold anything; NaN sizes
    pass (they match nothing)."""
    op = "simota_assign"
    bad_class = gt_valid & ((gt_classes < 0) | (gt_classes >= C))
    x0, y0, x1, y1 = gt_boxes.unbind(-1)
    # cxcywh: x1, y1 are the width and height
    low_x, low_y = (x0, y0) if xyxy else (0.0, 0.0)
    bad_size = gt_valid & ((x1 < low_x) | (y1 < low_y))
    bad_stride = anchor_strides < 0
    if gt_boxes.device.type != "cpu":
        if gt_boxes.numel() or anchor_strides.numel():
            ok = ~(bad_class.any() | bad_size.any() | bad_stride.any())
            torch._assert_async(ok, VALUE_ERROR)
        return
    if bool(bad_class.any()):
        raise ValueError(f"{op}: gt_classes of valid gts must lie in [0, {C})")
    if bool(bad_size.any()):
        b, g = (int(i) for i in bad_size.nonzero()[0])
        what = "x2 < x1 or y2 < y1" if xyxy else "a negative width or height"
        raise ValueError(f"{op}: gt_boxes[{b}, {g}] (a valid gt) has {what}")
    if bool(bad_stride.any()):
        a = int(bad_stride.nonzero()[0, 0])
        raise ValueError(f"{op}: anchor_strides must be >= 0, got anchor_strides[{a}] < 0")


def _call(args: tuple) -> tuple[tuple, tuple, tuple[int, int, int, int]]:
    """(the 8 tensors, (center_radius, center_only, geometry_penalty, box_format), (B, G, A, C))
    of the op's arguments, checked."""
    tensors, options = args[:8], (*args[8:], *_DEFAULTS[len(args) - 8 :])
    return tensors, options, _check(tensors, options[0], options[3])


def _outputs(B: int, A: int, device: torch.device) -> SimOTAAssignment:
    return SimOTAAssignment(
        torch.empty(B, A, dtype=torch.bool, device=device),
        torch.empty(B, A, dtype=torch.int64, device=device),
        torch.empty(B, A, dtype=torch.float32, device=device),
        torch.empty(B, dtype=torch.int64, device=device),
    )


def _corners(boxes: torch.Tensor, xyxy: bool) -> tuple[torch.Tensor, ...]:
    """(l, t, r, b, cx, cy, area) in float64, each ``boxes.shape[:-1]``."""
    q = boxes.float().double()
    a0, a1, a2, a3 = q.unbind(-1)
    if xyxy:
        return a0, a1, a2, a3, (a0 + a2) * 0.5, (a1 + a3) * 0.5, (a2 - a0) * (a3 - a1)
    return a0 - 0.5 * a2, a1 - 0.5 * a3, a0 + 0.5 * a2, a1 + 0.5 * a3, a0, a1, a2 * a3


def _neg_log_clamped(x: torch.Tensor) -> torch.Tensor:
    # -max(log(x), -100): binary_cross_entropy's clamp; NaN stays NaN (clamp keeps it)
    return (-torch.log(x)).clamp(max=100.0)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    # the kernel's formula, so both round alike
    return 1.0 / (1.0 + torch.exp(-x))


def _reference(*args: Any) -> tuple[torch.Tensor, ...]:
    """The reference: vectorised over images, gts and anchors ([B, G, A] tensors), float64;
    arguments as in the op's schema (see :func:`simota_assign`)."""
    tensors, options, (B, G, A, C) = _call(args)
    (gt_boxes, gt_classes, gt_valid, anchor_centers, anchor_strides, pred_boxes, cls_logits,
     obj_logits) = tensors  # fmt: skip
    center_radius, center_only, geometry_penalty, box_format = options
    device = gt_boxes.device
    in_range = (gt_classes >= 0) & (gt_classes < C)
    _check_values(gt_boxes, gt_classes, gt_valid, anchor_strides, C, box_format == "xyxy")
    out = _outputs(B, A, device)
    if B == 0 or A == 0 or G == 0:
        out.fg_mask.zero_()
        out.matched_gt.fill_(-1)
        out.matched_iou.zero_()
        out.num_fg.zero_()
        return tuple(out)
    usable = gt_valid & in_range  # [B, G]
    xyxy = box_format == "xyxy"
    gl, gt_, gr, gb, gcx, gcy, garea = (v[:, :, None] for v in _corners(gt_boxes, xyxy))
    pl, pt, pr, pb, _, _, parea = (v[:, None, :] for v in _corners(pred_boxes, xyxy))
    ax, ay = anchor_centers.float().double().unbind(-1)
    rs = center_radius * anchor_strides.float().double()

    # geometry [B, G, A]
    in_ctr = (
        ((ax - (gcx - rs)) > 0)
        & (((gcx + rs) - ax) > 0)
        & ((ay - (gcy - rs)) > 0)
        & (((gcy + rs) - ay) > 0)
    )
    in_box = ((ax - gl) > 0) & ((gr - ax) > 0) & ((ay - gt_) > 0) & ((gb - ay) > 0)
    reach = in_ctr if center_only else in_ctr | in_box
    cand = (reach & usable[:, :, None]).any(1)  # [B, A]
    relation = in_ctr if center_only else in_ctr & in_box

    # IoU [B, G, A] (YOLOX bboxes_iou; NaN or an empty union -> 0)
    tlx, tly = torch.maximum(gl, pl), torch.maximum(gt_, pt)
    brx, bry = torch.minimum(gr, pr), torch.minimum(gb, pb)
    inter = torch.where((tlx < brx) & (tly < bry), (brx - tlx) * (bry - tly), 0.0)
    union = (garea + parea) - inter
    iou = torch.where(union > 0, inter / union, 0.0).nan_to_num(nan=0.0)

    # cost [B, G, A]
    prob = torch.sqrt(
        _sigmoid(cls_logits.float().double()) * _sigmoid(obj_logits.float().double().view(B, A, 1))
    )  # [B, A, C]
    neg = _neg_log_clamped(1.0 - prob)
    bg_sum = torch.where(cand, neg.sum(-1), 0.0)  # [B, A]
    k = gt_classes.long().clamp(0, C - 1)[:, None, :].expand(B, A, G)
    neg_k = neg.gather(2, k).transpose(1, 2)  # [B, G, A]
    pos_k = _neg_log_clamped(prob.gather(2, k)).transpose(1, 2)
    cost = ((bg_sum[:, None, :] - neg_k) + pos_k) + 3.0 * (-torch.log(iou + 1e-8))
    if geometry_penalty:
        cost = cost + torch.where(relation, 0.0, 1e6 if center_only else 1e5)
    dmax = torch.finfo(torch.float64).max
    cost = cost.nan_to_num(nan=dmax, posinf=dmax, neginf=float("-inf"))

    # dynamic k: the 10 largest candidate IoUs, summed in descending order
    top = torch.where(cand[:, None, :], iou, 0.0).topk(min(_TOPK, A), dim=-1).values
    total = torch.zeros(B, G, dtype=torch.float64, device=device)
    for j in range(top.shape[-1]):  # fixed order, as the kernel's
        total = total + top[..., j]
    dyn_k = total.long().clamp(min=1)

    # each usable gt takes its dyn_k lowest-cost candidates (stable sort: lowest index first)
    usable3 = usable[:, :, None]
    picked_cost = torch.where(cand[:, None, :] & usable3, cost, float("inf"))
    order = torch.sort(picked_cost, dim=-1, stable=True).indices[..., :_TOPK]
    take = (
        (torch.arange(order.shape[-1], device=device) < dyn_k[..., None])
        & torch.isfinite(picked_cost.gather(2, order))
        & usable3
    )
    matching = torch.zeros(B, G, A, dtype=torch.bool, device=device)
    matching.scatter_(2, order, take)
    count = matching.sum(1)  # [B, A]

    # an anchor taken twice goes to the usable gt of lowest cost (lowest index on ties)
    ranked = torch.where(usable3, cost, float("inf"))
    lowest = (ranked == ranked.min(1, keepdim=True).values) & usable3
    contested = lowest.int().argmax(1)
    single = matching.int().argmax(1)
    matched = torch.where(count == 1, single, contested)
    matched = torch.where(count == 0, -1, matched)
    fg = count > 0
    m_iou = iou.gather(1, matched.clamp(min=0)[:, None, :]).squeeze(1)
    out.fg_mask.copy_(fg)
    out.matched_gt.copy_(matched)
    out.matched_iou.copy_(torch.where(fg, m_iou, 0.0))
    out.num_fg.copy_(fg.sum(1))
    return tuple(out)


def _simota_cuda(*args: Any) -> tuple[torch.Tensor, ...]:
    tensors, options, sizes = _call(args)
    if not use_kernel(SIMOTA, tensors[0].device, ()):
        return _reference(*tensors, *options)
    return launch_simota(tensors, sizes, *options)


def _fake(*args: Any) -> tuple[torch.Tensor, ...]:
    tensors, _, (B, _, A, _) = _call(args)
    return tuple(_outputs(B, A, tensors[0].device))


SIMOTA_OP = define(
    "simota_assign(Tensor gt_boxes, Tensor gt_classes, Tensor gt_valid, Tensor anchor_centers, "
    "Tensor anchor_strides, Tensor pred_boxes, Tensor cls_logits, Tensor obj_logits, "
    "float center_radius=2.5, bool center_only=False, bool geometry_penalty=True, "
    "str box_format='cxcywh') -> (Tensor, Tensor, Tensor, Tensor)",
    _reference,
    cuda=_simota_cuda,
    fake=_fake,
)


def simota_assign(
    gt_boxes: torch.Tensor,
    gt_classes: torch.Tensor,
    gt_valid: torch.Tensor,
    anchor_centers: torch.Tensor,
    anchor_strides: torch.Tensor,
    pred_boxes: torch.Tensor,
    cls_logits: torch.Tensor,
    obj_logits: torch.Tensor,
    *,
    center_radius: float = 2.5,
    center_only: bool = False,
    geometry_penalty: bool = True,
    box_format: str = "cxcywh",
) -> SimOTAAssignment:
    """SimOTA over a batch: gts ``[B, G, 4]`` (padded; ``gt_classes`` ``[B, G]`` int,
    ``gt_valid`` ``[B, G]`` bool), anchor centres ``[A, 2]`` and strides ``[A]`` in image
    pixels, ``pred_boxes`` ``[B, A, 4]`` (same ``box_format`` as the gts), ``cls_logits``
    ``[B, A, C]``, ``obj_logits`` ``[B, A]`` or ``[B, A, 1]``.

    YOLOX classic: the defaults (radius 2.5, box or centre). Newer YOLOX:
    ``center_radius=1.5, center_only=True``. YOLOv7's cost: ``geometry_penalty=False``.
    Never synchronises the host; see the module docstring for the exact rules and ties.
    """
    for name, value in (("center_only", center_only), ("geometry_penalty", geometry_penalty)):
        if not isinstance(value, bool):
            raise TypeError(f"simota_assign: {name} must be a bool, got {type(value).__name__}")
    if not isinstance(box_format, str):
        raise TypeError(f"simota_assign: box_format must be a str, got {type(box_format).__name__}")
    args = (
        gt_boxes, gt_classes, gt_valid, anchor_centers, anchor_strides, pred_boxes,
        cls_logits, obj_logits,
    )  # fmt: skip
    # before the dispatcher's own TypeError, so the message names the argument
    _check(args, center_radius, box_format)
    return SimOTAAssignment(
        *SIMOTA_OP(*args, float(center_radius), center_only, geometry_penalty, box_format)
    )
