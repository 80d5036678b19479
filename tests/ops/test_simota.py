"""aiak::simota_assign: the batched op against YOLOX's per-image get_assignments, written out
literally below (loops allowed), on random scenes and edge cases; the CUDA kernel against the
reference.

The literal reference breaks ties the way the op documents (lowest anchor index first among
equal costs, lowest gt index for a contested anchor) by a stable sort in place of topk, and
computes in float64 like the op (the op's docstring says why).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak.ops.simota import simota_assign

# --------------------------------------------------------------------------------------------
# YOLOX get_assignments, one image at a time (the literal reference)
# --------------------------------------------------------------------------------------------


def _ltrb(boxes: torch.Tensor, box_format: str) -> tuple[torch.Tensor, ...]:
    if box_format == "xyxy":
        x1, y1, x2, y2 = boxes.unbind(-1)
        return x1, y1, x2, y2, (x1 + x2) * 0.5, (y1 + y2) * 0.5
    cx, cy, w, h = boxes.unbind(-1)
    return cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h, cx, cy


def bboxes_iou(a: torch.Tensor, b: torch.Tensor, xyxy: bool) -> torch.Tensor:
    """YOLOX's bboxes_iou: [N, 4] x [M, 4] -> [N, M]."""
    if xyxy:
        tl = torch.max(a[:, None, :2], b[:, :2])
        br = torch.min(a[:, None, 2:], b[:, 2:])
        area_a = torch.prod(a[:, 2:] - a[:, :2], 1)
        area_b = torch.prod(b[:, 2:] - b[:, :2], 1)
    else:
        tl = torch.max(a[:, None, :2] - a[:, None, 2:] / 2, b[:, :2] - b[:, 2:] / 2)
        br = torch.min(a[:, None, :2] + a[:, None, 2:] / 2, b[:, :2] + b[:, 2:] / 2)
        area_a = torch.prod(a[:, 2:], 1)
        area_b = torch.prod(b[:, 2:], 1)
    en = (tl < br).type(tl.type()).prod(dim=2)
    area_i = torch.prod(br - tl, 2) * en
    return area_i / (area_a[:, None] + area_b - area_i)


def yolox_get_assignments(
    gt_boxes,  # [G, 4], only this image's gts
    gt_classes,  # [G]
    centers,  # [A, 2]
    strides,  # [A]
    pred_boxes,  # [A, 4]
    cls_logits,  # [A, C]
    obj_logits,  # [A]
    center_radius=2.5,
    center_only=False,
    geometry_penalty=True,
    box_format="cxcywh",
    dtype=torch.float64,
):
    """fg_mask [A], matched_gt_inds [A] (-1 background), pred_ious_this_matching [A].

    ``dtype=torch.float32`` is YOLOX as it runs (benchmarks/bench_detect.py times that)."""
    d, dev = dtype, pred_boxes.device
    gt_boxes, pred_boxes = gt_boxes.to(d), pred_boxes.to(d)
    A, C = cls_logits.shape
    num_gt = gt_boxes.shape[0]
    fg_out = torch.zeros(A, dtype=torch.bool, device=dev)
    matched_out = torch.full((A,), -1, dtype=torch.int64, device=dev)
    iou_out = torch.zeros(A, dtype=torch.float32, device=dev)
    if num_gt == 0:
        return fg_out, matched_out, iou_out

    # get_in_boxes_info / get_geometry_constraint
    x_c = centers[:, 0].to(d)[None]
    y_c = centers[:, 1].to(d)[None]
    gl, gt_, gr, gb, gcx, gcy = (v[:, None] for v in _ltrb(gt_boxes, box_format))
    bbox_deltas = torch.stack([x_c - gl, y_c - gt_, gr - x_c, gb - y_c], 2)
    is_in_boxes = bbox_deltas.min(dim=-1).values > 0.0
    center_dist = center_radius * strides.to(d)[None]
    c_l, c_r = gcx - center_dist, gcx + center_dist
    c_t, c_b = gcy - center_dist, gcy + center_dist
    center_deltas = torch.stack([x_c - c_l, y_c - c_t, c_r - x_c, c_b - y_c], 2)
    is_in_centers = center_deltas.min(dim=-1).values > 0.0
    if center_only:
        fg_mask = is_in_centers.sum(dim=0) > 0
        geometry_relation = is_in_centers[:, fg_mask]
        penalty = 1e6
    else:
        fg_mask = (is_in_boxes.sum(dim=0) > 0) | (is_in_centers.sum(dim=0) > 0)
        geometry_relation = is_in_boxes[:, fg_mask] & is_in_centers[:, fg_mask]
        penalty = 1e5
    candidates = fg_mask.nonzero().squeeze(1)
    num_in_boxes_anchor = candidates.numel()
    if num_in_boxes_anchor == 0:  # YOLOX's topk would raise; nothing can be matched
        return fg_out, matched_out, iou_out

    bboxes_preds = pred_boxes[fg_mask]
    cls_preds_ = cls_logits[fg_mask].to(d)
    obj_preds_ = obj_logits[fg_mask].to(d)[:, None]
    pair_wise_ious = bboxes_iou(gt_boxes, bboxes_preds, box_format == "xyxy")
    gt_cls_per_image = F.one_hot(gt_classes.to(torch.int64), C).to(d)
    pair_wise_ious_loss = -torch.log(pair_wise_ious + 1e-8)
    cls_preds_ = (cls_preds_.sigmoid() * obj_preds_.sigmoid()).sqrt()
    pair_wise_cls_loss = F.binary_cross_entropy(
        cls_preds_.unsqueeze(0).repeat(num_gt, 1, 1),
        gt_cls_per_image.unsqueeze(1).repeat(1, num_in_boxes_anchor, 1),
        reduction="none",
    ).sum(-1)
    cost = pair_wise_cls_loss + 3.0 * pair_wise_ious_loss
    if geometry_penalty:
        cost = cost + penalty * (~geometry_relation)

    # simota_matching
    matching_matrix = torch.zeros_like(cost, dtype=torch.uint8)
    n_candidate_k = min(10, pair_wise_ious.size(1))
    topk_ious, _ = torch.topk(pair_wise_ious, n_candidate_k, dim=1)
    dynamic_ks = torch.clamp(topk_ious.sum(1).int(), min=1)
    for gt_idx in range(num_gt):
        # topk(cost, k, largest=False) with ties broken by the lower anchor index
        pos_idx = torch.sort(cost[gt_idx], stable=True).indices[: int(dynamic_ks[gt_idx])]
        matching_matrix[gt_idx][pos_idx] = 1
    anchor_matching_gt = matching_matrix.sum(0)
    if anchor_matching_gt.max() > 1:
        multiple_match_mask = anchor_matching_gt > 1
        _, cost_argmin = torch.min(cost[:, multiple_match_mask], dim=0)
        matching_matrix[:, multiple_match_mask] *= 0
        matching_matrix[cost_argmin, multiple_match_mask] = 1
    fg_mask_inboxes = matching_matrix.sum(0) > 0
    matched_gt_inds = matching_matrix[:, fg_mask_inboxes].argmax(0)
    pred_ious_this_matching = (matching_matrix * pair_wise_ious).sum(0)[fg_mask_inboxes]

    fg_anchors = candidates[fg_mask_inboxes]
    fg_out[fg_anchors] = True
    matched_out[fg_anchors] = matched_gt_inds
    iou_out[fg_anchors] = pred_ious_this_matching.float()
    return fg_out, matched_out, iou_out


def per_image_loop(gt_boxes, gt_classes, gt_valid, centers, strides, pred, cls, obj, **opts):
    """The YOLOX-style loop over images of a padded batch; matched indices are padded ones."""
    B, A = pred.shape[:2]
    fg = torch.zeros(B, A, dtype=torch.bool)
    matched = torch.full((B, A), -1, dtype=torch.int64)
    ious = torch.zeros(B, A)
    for b in range(B):
        keep = gt_valid[b].nonzero().squeeze(1)
        f, m, i = yolox_get_assignments(
            gt_boxes[b, keep].cpu(), gt_classes[b, keep].cpu(), centers.cpu(), strides.cpu(),
            pred[b].cpu(), cls[b].cpu(), obj[b].reshape(A).cpu(), **opts,
        )  # fmt: skip
        fg[b], ious[b] = f, i
        if keep.numel():
            matched[b] = torch.where(m >= 0, keep[m.clamp(min=0)], -1)
    return fg, matched, ious, fg.sum(1)


# --------------------------------------------------------------------------------------------
# Scenes
# --------------------------------------------------------------------------------------------


def anchors(size: int, strides=(8, 16, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """YOLOX's grid: centres (x + 0.5) * stride on each level, row-major, levels in order."""
    centers, out_strides = [], []
    for s in strides:
        n = size // s
        ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        centers.append(torch.stack([(xs.flatten() + 0.5) * s, (ys.flatten() + 0.5) * s], 1))
        out_strides.append(torch.full((n * n,), float(s)))
    return torch.cat(centers).float(), torch.cat(out_strides)


def scene(B, G, C, size, box_format="cxcywh", valid_p=0.8, seed=0):
    """A padded batch: random gts (some padding), predictions scattered around them."""
    gen = torch.Generator().manual_seed(seed)
    centers, strides = anchors(size)
    A = centers.shape[0]
    xy = torch.rand(B, G, 2, generator=gen) * size
    wh = 4 + torch.rand(B, G, 2, generator=gen) * (size / 2)
    gt = torch.cat([xy, wh], -1)
    classes = torch.randint(0, C, (B, G), generator=gen)
    valid = torch.rand(B, G, generator=gen) < valid_p
    src = torch.randint(0, max(G, 1), (B, A), generator=gen)
    if G:
        base = gt.gather(1, src[..., None].expand(B, A, 4))
    else:
        base = torch.cat([centers.expand(B, A, 2), torch.full((B, A, 2), 8.0)], -1)
    pred = base + torch.randn(B, A, 4, generator=gen) * torch.tensor([4.0, 4.0, 3.0, 3.0])
    pred[..., 2:] = pred[..., 2:].abs() + 1
    cls = torch.randn(B, A, C, generator=gen) * 2
    obj = torch.randn(B, A, generator=gen) * 2
    if box_format == "xyxy":
        gt = torch.cat([gt[..., :2] - gt[..., 2:] / 2, gt[..., :2] + gt[..., 2:] / 2], -1)
        pred = torch.cat([pred[..., :2] - pred[..., 2:] / 2, pred[..., :2] + pred[..., 2:] / 2], -1)
    return gt, classes, valid, centers, strides, pred, cls, obj


MODES = {
    "classic": {"center_radius": 2.5, "center_only": False, "geometry_penalty": True},
    "center": {"center_radius": 1.5, "center_only": True, "geometry_penalty": True},
    "yolov7": {"center_radius": 2.5, "center_only": False, "geometry_penalty": False},
}


def assert_same(out, ref) -> None:
    fg, matched, ious, num_fg = ref
    assert torch.equal(out.fg_mask.cpu(), fg), "fg_mask differs"
    assert torch.equal(out.matched_gt.cpu(), matched), (
        f"matched_gt differs at {(out.matched_gt.cpu() != matched).nonzero()[:5].tolist()}"
    )
    torch.testing.assert_close(out.matched_iou.cpu(), ious, rtol=1e-6, atol=1e-7)
    assert torch.equal(out.num_fg.cpu(), num_fg)


def run_both(inputs, box_format="cxcywh", **opts):
    out = simota_assign(*inputs, box_format=box_format, **opts)
    ref = per_image_loop(*inputs, box_format=box_format, **opts)
    return out, ref


# --------------------------------------------------------------------------------------------
# Reference path (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("box_format", ["cxcywh", "xyxy"])
def test_equals_the_per_image_loop_on_random_scenes(mode, box_format) -> None:
    inputs = scene(3, 7, 6, 96, box_format=box_format, seed=1)
    out, ref = run_both(inputs, box_format=box_format, **MODES[mode])
    assert_same(out, ref)
    assert out.num_fg.sum() > 0  # the scene matches something


@settings(max_examples=12, deadline=None)
@given(
    B=st.integers(1, 3),
    G=st.integers(0, 9),
    C=st.integers(1, 7),
    size=st.sampled_from([32, 64, 96]),
    mode=st.sampled_from(list(MODES)),
    box_format=st.sampled_from(["cxcywh", "xyxy"]),
    valid_p=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_over_sizes(B, G, C, size, mode, box_format, valid_p, seed) -> None:
    inputs = scene(B, G, C, size, box_format=box_format, valid_p=valid_p, seed=seed)
    out, ref = run_both(inputs, box_format=box_format, **MODES[mode])
    assert_same(out, ref)


def test_image_without_gts_is_all_background() -> None:
    gt, classes, valid, centers, strides, pred, cls, obj = scene(3, 5, 4, 64, valid_p=1.0, seed=2)
    valid[1] = False
    out, ref = run_both((gt, classes, valid, centers, strides, pred, cls, obj))
    assert_same(out, ref)
    assert out.num_fg[1] == 0 and not out.fg_mask[1].any()
    assert (out.matched_gt[1] == -1).all() and (out.matched_iou[1] == 0).all()
    assert out.num_fg[0] > 0 and out.num_fg[2] > 0


def test_no_gt_at_all_and_empty_batch() -> None:
    inputs = scene(2, 0, 3, 64, seed=3)
    out, ref = run_both(inputs)
    assert_same(out, ref)
    assert out.num_fg.tolist() == [0, 0]
    gt, classes, valid, centers, strides, pred, cls, obj = scene(0, 4, 3, 64)
    out = simota_assign(gt, classes, valid, centers, strides, pred, cls, obj)
    assert out.fg_mask.shape == (0, centers.shape[0]) and out.num_fg.shape == (0,)


def test_gt_without_candidate_anchors_still_competes() -> None:
    # gt 1 lies far outside the image: no anchor is in its box or centre region, yet YOLOX
    # still gives it its dyn_k = 1 lowest-cost candidate of the image (penalised cost).
    gt, classes, valid, centers, strides, pred, cls, obj = scene(1, 2, 3, 64, valid_p=1.0, seed=4)
    gt[0, 1] = torch.tensor([-900.0, -900.0, 10.0, 10.0])
    out, ref = run_both((gt, classes, valid, centers, strides, pred, cls, obj))
    assert_same(out, ref)
    # and an image whose only gt has no candidates matches nothing
    gt2 = gt[:, 1:].clone()
    out, ref = run_both((gt2, classes[:, 1:], valid[:, 1:], centers, strides, pred, cls, obj))
    assert_same(out, ref)
    assert out.num_fg.item() == 0


def test_one_gt() -> None:
    for seed in range(4):
        inputs = scene(2, 1, 5, 64, valid_p=1.0, seed=10 + seed)
        out, ref = run_both(inputs)
        assert_same(out, ref)
        assert (out.matched_gt[out.fg_mask] == 0).all()
        assert (out.num_fg >= 1).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_every_anchor_contested(mode) -> None:
    # Large overlapping gts, a radius covering the image: every anchor is a candidate of
    # every gt and most picks collide.
    gt, classes, valid, centers, strides, pred, cls, obj = scene(2, 8, 3, 64, valid_p=1.0, seed=5)
    gt[..., :2] = 32 + torch.randn(2, 8, 2) * 2
    gt[..., 2:] = 60 + torch.rand(2, 8, 2) * 4
    pred[..., :2] = 32 + torch.randn_like(pred[..., :2]) * 3
    pred[..., 2:] = 58 + torch.rand_like(pred[..., 2:]) * 6
    opts = {**MODES[mode], "center_radius": 100.0}
    out, ref = run_both((gt, classes, valid, centers, strides, pred, cls, obj), **opts)
    assert_same(out, ref)
    assert out.matched_gt[out.fg_mask].unique().numel() > 1


def test_exact_ties_go_to_the_lowest_indices() -> None:
    # Three identical gts, identical predictions and logits everywhere: every cost ties.
    # Each gt takes the lowest-index anchors; each of those is contested and goes to gt 0.
    centers, strides = anchors(64)
    A = centers.shape[0]
    gt = torch.tensor([[[32.0, 32.0, 40.0, 40.0]] * 3])
    pred = torch.tensor([32.0, 32.0, 40.0, 40.0]).expand(1, A, 4).clone()
    cls = torch.zeros(1, A, 4)
    obj = torch.zeros(1, A)
    classes = torch.tensor([[1, 1, 1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    out, ref = run_both(
        (gt, classes, valid, centers, strides, pred, cls, obj),
        **{**MODES["yolov7"], "center_radius": 100.0},
    )
    assert_same(out, ref)
    # IoU 1 everywhere: dyn_k = 10
    assert out.fg_mask[0].nonzero().squeeze(1).tolist() == list(range(10))
    assert (out.matched_gt[0, :10] == 0).all()


def test_outputs_and_obj_shapes() -> None:
    inputs = list(scene(2, 4, 3, 64, seed=6))
    a = simota_assign(*inputs)
    inputs[-1] = inputs[-1][..., None]  # [B, A, 1]
    b = simota_assign(*inputs)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert a.fg_mask.dtype == torch.bool and a.matched_gt.dtype == torch.int64
    assert a.matched_iou.dtype == torch.float32 and a.num_fg.dtype == torch.int64


def test_half_precision_inputs_are_read_as_fp32() -> None:
    inputs = scene(2, 5, 4, 64, seed=7)
    half = [t.half() if t.is_floating_point() and i >= 5 else t for i, t in enumerate(inputs)]
    as_f32 = [t.float() if t.is_floating_point() else t for t in half]
    for x, y in zip(simota_assign(*half), simota_assign(*as_f32)):
        assert torch.equal(x, y)


def test_nan_logits_never_win() -> None:
    gt, classes, valid, centers, strides, pred, cls, obj = scene(1, 3, 4, 64, valid_p=1.0, seed=8)
    clean = simota_assign(gt, classes, valid, centers, strides, pred, cls, obj)
    chosen = clean.fg_mask[0].nonzero().squeeze(1)
    cls[0, chosen[0]] = float("nan")
    out = simota_assign(gt, classes, valid, centers, strides, pred, cls, obj)
    assert not out.fg_mask[0, chosen[0]] or out.num_fg.item() > 0
    assert torch.isfinite(out.matched_iou).all()


def _bad(**changes):
    inputs = dict(
        zip(
            ["gt_boxes", "gt_classes", "gt_valid", "anchor_centers", "anchor_strides",
             "pred_boxes", "cls_logits", "obj_logits"],
            scene(2, 3, 4, 32, seed=9),
        )
    )  # fmt: skip
    opts = {}
    for k, v in changes.items():
        (inputs if k in inputs else opts)[k] = v(inputs[k]) if callable(v) else v
    return inputs, opts


@pytest.mark.parametrize(
    ("changes", "exc", "match"),
    [
        ({"gt_boxes": lambda t: t[..., :3]}, ValueError, "gt_boxes must be"),
        ({"gt_classes": lambda t: t.float()}, TypeError, "gt_classes has dtype"),
        ({"gt_valid": lambda t: t.int()}, TypeError, "gt_valid has dtype"),
        ({"gt_valid": lambda t: t[:1]}, ValueError, "gt_valid must be"),
        ({"anchor_centers": lambda t: t[:, :1]}, ValueError, "anchor_centers must be"),
        ({"anchor_strides": lambda t: t[1:]}, ValueError, "anchor_strides must be"),
        ({"pred_boxes": lambda t: t[:, 1:]}, ValueError, "pred_boxes must be"),
        ({"cls_logits": lambda t: t[..., :0]}, ValueError, "cls_logits must be"),
        ({"cls_logits": lambda t: t.double()}, TypeError, "cls_logits has dtype"),
        ({"obj_logits": lambda t: t[..., None, None]}, ValueError, "obj_logits must be"),
        ({"obj_logits": "x"}, TypeError, "obj_logits must be a tensor"),
        ({"gt_classes": lambda t: t + 10}, ValueError, "gt_classes of valid gts"),
        ({"center_radius": 0.0}, ValueError, "center_radius must be positive"),
        ({"center_radius": "2"}, TypeError, "center_radius must be a number"),
        ({"box_format": "xywh"}, ValueError, "box_format must be one of"),
        ({"center_only": 1}, TypeError, "center_only must be a bool"),
    ],
)
def test_bad_arguments_are_named(changes, exc, match) -> None:
    inputs, opts = _bad(**changes)
    with pytest.raises(exc, match=match):
        simota_assign(**inputs, **opts)


def test_invalid_gt_with_a_bad_class_is_ignored() -> None:
    gt, classes, valid, centers, strides, pred, cls, obj = scene(1, 3, 4, 64, valid_p=1.0, seed=11)
    valid[0, 1] = False
    classes[0, 1] = 99  # padding may hold anything
    out, ref = run_both((gt, classes, valid, centers, strides, pred, cls, obj))
    assert_same(out, ref)


@pytest.mark.parametrize("mode", list(MODES))
def test_opcheck(mode) -> None:
    gt, classes, valid, centers, strides, pred, cls, obj = scene(2, 4, 3, 64, seed=12)
    o = MODES[mode]
    torch.library.opcheck(
        torch.ops.aiak.simota_assign.default,
        (gt, classes, valid, centers, strides, pred, cls, obj, o["center_radius"],
         o["center_only"], o["geometry_penalty"], "cxcywh"),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# CUDA kernel
# --------------------------------------------------------------------------------------------


def _cuda(inputs):
    return [t.cuda() for t in inputs]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("box_format", ["cxcywh", "xyxy"])
@pytest.mark.parametrize(("B", "G", "C", "size", "valid_p"), [
    (3, 7, 6, 96, 0.8),
    (2, 0, 3, 64, 1.0),
    (4, 50, 80, 640, 0.5),
    (2, 12, 80, 640, 1.0),
])  # fmt: skip
def test_cuda_kernel_equals_the_reference(mode, box_format, B, G, C, size, valid_p) -> None:
    import aiak.ops

    assert aiak.ops.backends()["ops"]["simota_assign"] == "cupy"
    inputs = scene(B, G, C, size, box_format=box_format, valid_p=valid_p, seed=B * G + C)
    ref = simota_assign(*inputs, box_format=box_format, **MODES[mode])
    out = simota_assign(*_cuda(inputs), box_format=box_format, **MODES[mode])
    assert out.fg_mask.is_cuda
    assert_same(out, tuple(ref))


@pytest.mark.cuda
def test_cuda_edge_cases_equal_the_reference() -> None:
    cases = []
    gt, classes, valid, centers, strides, pred, cls, obj = scene(3, 5, 4, 64, valid_p=1.0, seed=2)
    valid[1] = False
    cases.append(((gt, classes, valid, centers, strides, pred, cls, obj), {}))
    gt, classes, valid, centers, strides, pred, cls, obj = scene(1, 2, 3, 64, valid_p=1.0, seed=4)
    gt[0, 1] = torch.tensor([-900.0, -900.0, 10.0, 10.0])
    cases.append(((gt, classes, valid, centers, strides, pred, cls, obj), {}))
    centers, strides = anchors(64)
    A = centers.shape[0]
    tie = (
        torch.tensor([[[32.0, 32.0, 40.0, 40.0]] * 3]),
        torch.tensor([[1, 1, 1]]),
        torch.ones(1, 3, dtype=torch.bool),
        centers,
        strides,
        torch.tensor([32.0, 32.0, 40.0, 40.0]).expand(1, A, 4).clone(),
        torch.zeros(1, A, 4),
        torch.zeros(1, A),
    )
    cases.append((tie, {**MODES["yolov7"], "center_radius": 100.0}))
    nan_scene = list(scene(2, 4, 4, 64, valid_p=1.0, seed=8))
    nan_scene[6][0, ::7] = float("nan")
    cases.append((tuple(nan_scene), {}))
    for inputs, opts in cases:
        ref = simota_assign(*inputs, **opts)
        out = simota_assign(*_cuda(inputs), **opts)
        assert_same(out, tuple(ref))


@pytest.mark.cuda
def test_cuda_kernel_does_not_synchronise_the_host() -> None:
    inputs = _cuda(scene(4, 12, 80, 640, seed=13))
    simota_assign(*inputs)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = simota_assign(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.num_fg.sum().item() > 0


@pytest.mark.cuda
def test_cuda_opcheck() -> None:
    gt, classes, valid, centers, strides, pred, cls, obj = _cuda(scene(2, 4, 3, 64, seed=12))
    torch.library.opcheck(
        torch.ops.aiak.simota_assign.default,
        (gt, classes, valid, centers, strides, pred, cls, obj, 2.5, False, True, "cxcywh"),
    )
