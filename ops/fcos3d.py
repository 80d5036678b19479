"""``aiak::fcos3d_targets``: FCOS3D's per-point training targets for a whole batch, one launch.

mmdet3d's ``FCOSMono3DHead._get_target_single`` runs once per image and picks each point's gt
with ``targets[range(num_points), min_dist_inds]``: Python builds an index of ~31k points on
the host and copies it to the GPU, twice per image. This op takes the batch with padded gts
and computes every (image, point) in one kernel; nothing is built on the host per step.

Semantics (mmdet3d's, per image over its valid gts, float32 throughout):

- ``bbox_targets`` = (l, t, r, b): the point's distances to the 2D box edges.
- a gt is eligible for a point when the point lies strictly inside the square of half-side
  ``center_sample_radius * stride`` around the gt's projected 3D centre (``centers2d``) and
  ``max(l, t, r, b)`` lies in the point's regress range ``[lo, hi]`` (both ends included);
- the eligible gt of nearest centre wins (the lowest gt index on equal distances);
- ``bbox_targets_3d`` = (dx, dy, depth, box3d[3:]) with box3d[6] turned into the local yaw
  ``-atan2(x, z) + yaw``; ``centerness = exp(-alpha * ||(dx, dy)|| / (1.414 * radius * stride))``;
- a point with no eligible gt is background (``background_label``, ``attr_background_label``)
  and, as in mmdet3d, keeps the targets of the image's first valid gt; an image without valid
  gts gets zero targets and zero centerness.

Per-point data is given as tensors built once per input size (:func:`point_meta`): the stride
of each point's level and its regress range.

Read top-down: checks, the PyTorch reference (the default kernel on every device), the CUDA
launcher, the op declaration, the public functions.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from aiak.ops import _cuda
from aiak.ops._args import check_float, check_int, check_sequence
from aiak.ops._capability import Capability, declare, use_kernel
from aiak.ops._driver import Kernel
from aiak.ops._registry import define

__all__ = ["FCOS3DTargets", "fcos3d_targets", "point_meta"]

FCOS3D = declare(Capability("fcos3d_targets", dtypes=(torch.float32,)))
_SOURCE = "fcos3d.cu"
_OPTIONS = ("-std=c++17", "--fmad=false")
_BLOCK = 256
_TARGETS = Kernel(
    _SOURCE,
    "fcos3d_targets",
    "ptr points, ptr point_strides, ptr regress_ranges, ptr gt_bboxes, ptr gt_labels, "
    "ptr gt_bboxes_3d, ptr gt_labels_3d, ptr centers2d, ptr depths, ptr attr_labels, "
    "ptr gt_valid, ptr labels, ptr bbox_targets, ptr labels_3d, ptr bbox_targets_3d, "
    "ptr centerness, ptr attr_out, i32 P, i32 G, i32 code, f64 radius, f32 neg_alpha, "
    "i64 background_label, i64 attr_background_label",
    options=_OPTIONS,
)
FAR = 1e8  # mmdet3d's INF


class FCOS3DTargets(NamedTuple):
    """``labels`` [B, P] int64, ``bbox_targets`` [B, P, 4], ``labels_3d`` [B, P] int64,
    ``bbox_targets_3d`` [B, P, code], ``centerness`` [B, P], ``attr_labels`` [B, P] int64."""

    labels: torch.Tensor
    bbox_targets: torch.Tensor
    labels_3d: torch.Tensor
    bbox_targets_3d: torch.Tensor
    centerness: torch.Tensor
    attr_labels: torch.Tensor


_NAMES = (
    "points",
    "point_strides",
    "regress_ranges",
    "gt_bboxes",
    "gt_labels",
    "gt_bboxes_3d",
    "gt_labels_3d",
    "centers2d",
    "depths",
    "attr_labels",
    "gt_valid",
)
_LONG = {"gt_labels", "gt_labels_3d", "attr_labels"}


def _check(*tensors: torch.Tensor, radius: float, alpha: float) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of the 11 tensors; returns (B, P, G, code)."""
    op = "fcos3d_targets"
    for name, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        want = torch.int64 if name in _LONG else torch.bool if name == "gt_valid" else torch.float32
        if t.dtype != want:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}, expected {want}")
    points, strides, ranges, boxes, _, boxes_3d = tensors[:6]
    if points.dim() != 2 or points.shape[1] != 2:
        raise ValueError(f"{op}: points must be [P, 2], got {tuple(points.shape)}")
    P = points.shape[0]
    if tuple(strides.shape) != (P,):
        raise ValueError(f"{op}: point_strides must be [P] = [{P}], got {tuple(strides.shape)}")
    if tuple(ranges.shape) != (P, 2):
        raise ValueError(
            f"{op}: regress_ranges must be [P, 2] = [{P}, 2], got {tuple(ranges.shape)}"
        )
    if boxes.dim() != 3 or boxes.shape[2] != 4:
        raise ValueError(f"{op}: gt_bboxes must be [B, G, 4], got {tuple(boxes.shape)}")
    B, G = boxes.shape[:2]
    if boxes_3d.dim() != 3 or tuple(boxes_3d.shape[:2]) != (B, G) or boxes_3d.shape[2] < 7:
        raise ValueError(
            f"{op}: gt_bboxes_3d must be [B, G, code >= 7] = [{B}, {G}, code] (the yaw is "
            f"column 6), got {tuple(boxes_3d.shape)}"
        )
    shapes = {"centers2d": (B, G, 2)}
    for name, t in zip(_NAMES[4:], tensors[4:]):
        if name == "gt_bboxes_3d":
            continue
        want = shapes.get(name, (B, G))
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} must be {list(want)}, got {tuple(t.shape)}")
    device = points.device
    for name, t in zip(_NAMES[1:], tensors[1:]):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but points is on {device}")
    for name, v in (("center_sample_radius", radius), ("centerness_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{op}: {name} must be a number, got {type(v).__name__}")
    if not 0 < radius <= sys.float_info.max:  # NaN, inf and ints beyond a float fail
        raise ValueError(f"{op}: center_sample_radius must be positive and finite, got {radius}")
    # NaN would make every centerness NaN; a negative alpha, centerness above 1
    check_float("centerness_alpha", alpha, ge=0, op=op)
    if max(B * P, G) >= 2**31 or B > 65535:
        raise ValueError(f"{op}: sizes B={B}, P={P}, G={G} are beyond the kernel's grid")
    return B, P, G, boxes_3d.shape[2]


# the schema's center_sample_radius and centerness_alpha: the dispatcher leaves out trailing
# arguments equal to their defaults, so reference, kernel and fake may receive 13 arguments
_DEFAULTS = (1.5, 2.5)


def _call(args: tuple) -> tuple[tuple, tuple, tuple[int, int, int, int]]:
    """(the 11 tensors, (background_label, attr_background_label, center_sample_radius,
    centerness_alpha), (B, P, G, code)) of the op's arguments, checked."""
    tensors, scalars = args[:11], (*args[11:], *_DEFAULTS[len(args) - 13 :])
    return tensors, scalars, _check(*tensors, radius=scalars[2], alpha=scalars[3])


def _outputs(B: int, P: int, code: int, device: torch.device) -> FCOS3DTargets:
    long, f32 = torch.int64, torch.float32
    return FCOS3DTargets(
        torch.empty(B, P, dtype=long, device=device),
        torch.empty(B, P, 4, dtype=f32, device=device),
        torch.empty(B, P, dtype=long, device=device),
        torch.empty(B, P, code, dtype=f32, device=device),
        torch.empty(B, P, dtype=f32, device=device),
        torch.empty(B, P, dtype=long, device=device),
    )


# --------------------------------------------------------------------------------------------
# Reference: [B, P, G] tensors, the same float32 operations as mmdet3d's, gathers for indexing.
# --------------------------------------------------------------------------------------------


def _reference(*args: Any) -> tuple[torch.Tensor, ...]:
    """The reference; arguments as in the op's schema (see :func:`fcos3d_targets`)."""
    tensors, scalars, (B, P, G, code) = _call(args)
    (points, point_strides, regress_ranges, gt_bboxes, gt_labels, gt_bboxes_3d, gt_labels_3d,
     centers2d, depths, attr_labels, gt_valid) = tensors  # fmt: skip
    background_label, attr_background_label, center_sample_radius, centerness_alpha = scalars
    device = points.device
    out = _outputs(B, P, code, device)
    if B * P == 0:
        return tuple(out)
    if G == 0:
        out.labels.fill_(background_label)
        out.labels_3d.fill_(background_label)
        out.attr_labels.fill_(attr_background_label)
        for t in (out.bbox_targets, out.bbox_targets_3d, out.centerness):
            t.zero_()
        return tuple(out)
    # local yaw, as mmdet3d rewrites gt_bboxes_3d[..., 6] (on a copy here)
    boxes_3d = gt_bboxes_3d.clone()
    boxes_3d[..., 6] = -torch.atan2(gt_bboxes_3d[..., 0], gt_bboxes_3d[..., 2]) + boxes_3d[..., 6]
    xs = points[:, 0][None, :, None]  # [1, P, 1]
    ys = points[:, 1][None, :, None]
    cx = centers2d[..., 0][:, None, :]  # [B, 1, G]
    cy = centers2d[..., 1][:, None, :]
    x1, y1, x2, y2 = (v[:, None, :] for v in gt_bboxes.unbind(-1))
    stride = (point_strides.double() * center_sample_radius).float()[None, :, None]
    delta_x, delta_y = xs - cx, ys - cy  # [B, P, G]
    left, top, right, bottom = xs - x1, ys - y1, x2 - xs, y2 - ys
    inside = (
        ((xs - (cx - stride)) > 0)
        & ((ys - (cy - stride)) > 0)
        & (((cx + stride) - xs) > 0)
        & (((cy + stride) - ys) > 0)
    )
    far = torch.stack((left, top, right, bottom), -1).max(-1).values
    lo = regress_ranges[:, 0][None, :, None]
    hi = regress_ranges[:, 1][None, :, None]
    dists = torch.sqrt(delta_x**2 + delta_y**2)
    dists = torch.where(inside & (far >= lo) & (far <= hi), dists, FAR)
    # padded gts lie beyond FAR: never nearest, and an all-FAR row picks the first valid gt
    dists = torch.where(gt_valid[:, None, :], dists, float("inf"))
    min_dist, idx = dists.min(dim=2)  # first index on ties
    fg = min_dist < FAR  # padded-only rows are inf: background too
    any_gt = gt_valid.any(1)[:, None]  # [B, 1]
    bg_label = torch.full((), background_label, dtype=torch.int64, device=device)
    attr_bg = torch.full((), attr_background_label, dtype=torch.int64, device=device)

    def pick(v: torch.Tensor) -> torch.Tensor:  # [B, P, G] -> [B, P]
        return v.gather(2, idx[..., None]).squeeze(2)

    def per_gt(v: torch.Tensor) -> torch.Tensor:  # [B, G, ...] -> [B, P, ...]
        tail = v.shape[2:]
        index = idx.view(B, P, *([1] * len(tail))).expand(B, P, *tail)
        return v.gather(1, index)

    zero = torch.zeros((), device=device)
    out.labels.copy_(torch.where(fg, per_gt(gt_labels), bg_label))
    out.labels_3d.copy_(torch.where(fg, per_gt(gt_labels_3d), bg_label))
    out.attr_labels.copy_(torch.where(fg, per_gt(attr_labels), attr_bg))
    bt = torch.stack((pick(left), pick(top), pick(right), pick(bottom)), -1)
    out.bbox_targets.copy_(torch.where(any_gt[..., None], bt, zero))
    dx, dy = pick(delta_x), pick(delta_y)
    bt3 = torch.cat((dx[..., None], dy[..., None], per_gt(depths)[..., None],
                     per_gt(boxes_3d[..., 3:])), -1)  # fmt: skip
    out.bbox_targets_3d.copy_(torch.where(any_gt[..., None], bt3, zero))
    rel = torch.sqrt(dx**2 + dy**2) / (1.414 * stride[..., 0])
    centerness = torch.exp(-centerness_alpha * rel)
    out.centerness.copy_(torch.where(any_gt, centerness, zero))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# CUDA: one launch, one thread per (image, point).
# --------------------------------------------------------------------------------------------


def _fcos3d_cuda(*args: Any) -> tuple[torch.Tensor, ...]:
    tensors, scalars, (B, P, G, code) = _call(args)
    background_label, attr_background_label, center_sample_radius, centerness_alpha = scalars
    points = tensors[0]
    if not use_kernel(FCOS3D, points.device, ()):
        return _reference(*tensors, *scalars)
    out = _outputs(B, P, code, points.device)
    if B * P == 0:
        return tuple(out)
    ins = [t.contiguous() for t in tensors]  # contiguous() is free for the usual layout
    with _cuda.on_device(points.device):
        _TARGETS(
            (-(-P // _BLOCK), B), _BLOCK, *ins, *out, P, G, code,
            center_sample_radius, -centerness_alpha, background_label, attr_background_label,
        )  # fmt: skip
    return tuple(out)


def _fake(*args: Any) -> tuple[torch.Tensor, ...]:
    tensors, _, (B, P, _, code) = _call(args)
    return tuple(_outputs(B, P, code, tensors[0].device))


FCOS3D_OP = define(
    "fcos3d_targets(Tensor points, Tensor point_strides, Tensor regress_ranges, "
    "Tensor gt_bboxes, Tensor gt_labels, Tensor gt_bboxes_3d, Tensor gt_labels_3d, "
    "Tensor centers2d, Tensor depths, Tensor attr_labels, Tensor gt_valid, "
    "int background_label, int attr_background_label, float center_sample_radius=1.5, "
    "float centerness_alpha=2.5) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _reference,
    cuda=_fcos3d_cuda,
    fake=_fake,
)


def point_meta(
    num_points_per_level: Sequence[int],
    strides: Sequence[float],
    regress_ranges: Sequence[tuple[float, float]],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(point_strides [P], regress_ranges [P, 2])`` for points laid out level by level, as
    mmdet3d concatenates them; build it once per input size."""
    op = "point_meta"
    n = [
        check_int(f"num_points_per_level[{i}]", v, ge=0, op=op)
        for i, v in enumerate(check_sequence("num_points_per_level", num_points_per_level, op=op))
    ]
    strides = [
        check_float(f"strides[{i}]", v, gt=0, op=op)
        for i, v in enumerate(check_sequence("strides", strides, op=op))
    ]
    ranges = []
    for i, pair in enumerate(check_sequence("regress_ranges", regress_ranges, op=op)):
        pair = check_sequence(f"regress_ranges[{i}]", pair, op=op)
        if len(pair) != 2:
            raise ValueError(f"{op}: regress_ranges[{i}] must be a (low, high) pair, got {pair!r}")
        # mmdet3d's ranges are open above with a huge or infinite high end
        lo = check_float(f"regress_ranges[{i}][0]", pair[0], finite=False, op=op)
        hi = check_float(f"regress_ranges[{i}][1]", pair[1], finite=False, op=op)
        if not lo <= hi:
            raise ValueError(f"{op}: regress_ranges[{i}] = ({lo}, {hi}) has low > high")
        ranges.append((lo, hi))
    regress_ranges = ranges
    if not (len(n) == len(strides) == len(regress_ranges)):
        raise ValueError(
            f"point_meta: num_points_per_level ({len(n)}), strides ({len(strides)}) and "
            f"regress_ranges ({len(regress_ranges)}) must have one entry per level"
        )
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(f"{op}: device must be a torch.device or str, got {device!r}")
    counts = torch.tensor(n, dtype=torch.int64)
    s = torch.tensor([float(v) for v in strides], dtype=torch.float32)
    r = torch.tensor([[float(a), float(b)] for a, b in regress_ranges], dtype=torch.float32)
    return (
        s.repeat_interleave(counts).to(device),
        r.repeat_interleave(counts, dim=0).to(device),
    )


def fcos3d_targets(
    points: torch.Tensor,
    point_strides: torch.Tensor,
    regress_ranges: torch.Tensor,
    gt_bboxes: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_bboxes_3d: torch.Tensor,
    gt_labels_3d: torch.Tensor,
    centers2d: torch.Tensor,
    depths: torch.Tensor,
    attr_labels: torch.Tensor,
    gt_valid: torch.Tensor,
    *,
    background_label: int,
    attr_background_label: int,
    center_sample_radius: float = 1.5,
    centerness_alpha: float = 2.5,
) -> FCOS3DTargets:
    """FCOS3D targets for a batch: points ``[P, 2]`` with their level's stride ``[P]`` and
    regress range ``[P, 2]`` (:func:`point_meta`); padded gts: ``gt_bboxes`` ``[B, G, 4]``
    (x1, y1, x2, y2), ``gt_labels`` / ``gt_labels_3d`` / ``attr_labels`` ``[B, G]`` int64,
    ``gt_bboxes_3d`` ``[B, G, code >= 7]``, ``centers2d`` ``[B, G, 2]``, ``depths`` ``[B, G]``,
    ``gt_valid`` ``[B, G]`` bool. float32 tensors on one device. Never synchronises the host.
    mmdet3d's defaults: ``background_label = num_classes``, ``attr_background_label =
    num_attrs``; see the module docstring for the rules.
    """
    tensors = (
        points, point_strides, regress_ranges, gt_bboxes, gt_labels, gt_bboxes_3d,
        gt_labels_3d, centers2d, depths, attr_labels, gt_valid,
    )  # fmt: skip
    for name, v in (
        ("background_label", background_label),
        ("attr_background_label", attr_background_label),
    ):
        # written into int64 outputs
        check_int(name, v, ge=-(2**63), lt=2**63, op="fcos3d_targets")
    _check(*tensors, radius=center_sample_radius, alpha=centerness_alpha)
    return FCOS3DTargets(
        *FCOS3D_OP(
            *tensors, background_label, attr_background_label, float(center_sample_radius),
            float(centerness_alpha),
        )
    )  # fmt: skip
