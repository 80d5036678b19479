"""aiak::fcos3d_targets: the batched op against mmdet3d's FCOSMono3DHead._get_target_single,
written out literally below (one image at a time, the host-built ``range(num_points)`` index
included), on random scenes and edge cases; the CUDA kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak.ops.fcos3d import fcos3d_targets, point_meta

INF = 1e8
STRIDES = (8, 16, 32, 64, 128)
REGRESS_RANGES = ((-1, 48), (48, 96), (96, 192), (192, 384), (384, INF))
NUM_CLASSES, NUM_ATTRS = 10, 9


# --------------------------------------------------------------------------------------------
# mmdet3d, one image at a time (the literal reference)
# --------------------------------------------------------------------------------------------


def mmdet3d_get_target_single(
    gt_bboxes, gt_labels, gt_bboxes_3d, gt_labels_3d, centers2d, depths, attr_labels,
    points, regress_ranges, num_points_per_lvl, strides=STRIDES, radius=1.5, alpha=2.5,
    background_label=NUM_CLASSES, attr_background_label=NUM_ATTRS,
):  # fmt: skip
    num_points = points.size(0)
    num_gts = gt_labels.size(0)
    code = gt_bboxes_3d.size(-1)
    if num_gts == 0:
        return (
            gt_labels.new_full((num_points,), background_label),
            gt_bboxes.new_zeros((num_points, 4)),
            gt_labels_3d.new_full((num_points,), background_label),
            gt_bboxes_3d.new_zeros((num_points, code)),
            gt_bboxes_3d.new_zeros((num_points,)),
            attr_labels.new_full((num_points,), attr_background_label),
        )
    gt_bboxes_3d = gt_bboxes_3d.clone()
    # change orientation to local yaw
    gt_bboxes_3d[..., 6] = (
        -torch.atan2(gt_bboxes_3d[..., 0], gt_bboxes_3d[..., 2]) + gt_bboxes_3d[..., 6]
    )
    regress_ranges = regress_ranges[:, None, :].expand(num_points, num_gts, 2)
    gt_bboxes = gt_bboxes[None].expand(num_points, num_gts, 4)
    centers2d = centers2d[None].expand(num_points, num_gts, 2)
    gt_bboxes_3d = gt_bboxes_3d[None].expand(num_points, num_gts, code)
    depths = depths[None, :, None].expand(num_points, num_gts, 1)
    xs, ys = points[:, 0], points[:, 1]
    xs = xs[:, None].expand(num_points, num_gts)
    ys = ys[:, None].expand(num_points, num_gts)

    delta_xs = (xs - centers2d[..., 0])[..., None]
    delta_ys = (ys - centers2d[..., 1])[..., None]
    bbox_targets_3d = torch.cat((delta_xs, delta_ys, depths, gt_bboxes_3d[..., 3:]), dim=-1)

    left = xs - gt_bboxes[..., 0]
    right = gt_bboxes[..., 2] - xs
    top = ys - gt_bboxes[..., 1]
    bottom = gt_bboxes[..., 3] - ys
    bbox_targets = torch.stack((left, top, right, bottom), -1)

    # condition1: inside a `center bbox`
    center_xs = centers2d[..., 0]
    center_ys = centers2d[..., 1]
    center_gts = torch.zeros_like(gt_bboxes)
    stride = center_xs.new_zeros(center_xs.shape)
    lvl_begin = 0
    for lvl_idx, num_points_lvl in enumerate(num_points_per_lvl):
        lvl_end = lvl_begin + num_points_lvl
        stride[lvl_begin:lvl_end] = strides[lvl_idx] * radius
        lvl_begin = lvl_end
    center_gts[..., 0] = center_xs - stride
    center_gts[..., 1] = center_ys - stride
    center_gts[..., 2] = center_xs + stride
    center_gts[..., 3] = center_ys + stride
    cb_dist_left = xs - center_gts[..., 0]
    cb_dist_right = center_gts[..., 2] - xs
    cb_dist_top = ys - center_gts[..., 1]
    cb_dist_bottom = center_gts[..., 3] - ys
    center_bbox = torch.stack((cb_dist_left, cb_dist_top, cb_dist_right, cb_dist_bottom), -1)
    inside_gt_bbox_mask = center_bbox.min(-1)[0] > 0

    # condition2: limit the regression range for each location
    max_regress_distance = bbox_targets.max(-1)[0]
    inside_regress_range = (max_regress_distance >= regress_ranges[..., 0]) & (
        max_regress_distance <= regress_ranges[..., 1]
    )

    # center-based criterion to deal with ambiguity
    dists = torch.sqrt(torch.sum(bbox_targets_3d[..., :2] ** 2, dim=-1))
    dists[inside_gt_bbox_mask == 0] = INF
    dists[inside_regress_range == 0] = INF
    min_dist, min_dist_inds = dists.min(dim=1)

    labels = gt_labels[min_dist_inds]
    labels_3d = gt_labels_3d[min_dist_inds]
    attr_labels = attr_labels[min_dist_inds]
    labels[min_dist == INF] = background_label
    labels_3d[min_dist == INF] = background_label
    attr_labels[min_dist == INF] = attr_background_label

    bbox_targets = bbox_targets[range(num_points), min_dist_inds]
    bbox_targets_3d = bbox_targets_3d[range(num_points), min_dist_inds]
    relative_dists = torch.sqrt(torch.sum(bbox_targets_3d[..., :2] ** 2, dim=-1)) / (
        1.414 * stride[:, 0]
    )
    centerness_targets = torch.exp(-alpha * relative_dists)
    return labels, bbox_targets, labels_3d, bbox_targets_3d, centerness_targets, attr_labels


def per_image_loop(points, num_points_per_lvl, gts, **opts):
    """mmdet3d's get_targets: regress ranges expanded per level, then the loop over images."""
    ranges = torch.cat(
        [
            points.new_tensor(r)[None].expand(n, 2)
            for r, n in zip(REGRESS_RANGES, num_points_per_lvl)
        ]
    )  # fmt: skip
    boxes, labels, boxes_3d, labels_3d, centers2d, depths, attrs, valid = gts
    outs = []
    for b in range(boxes.shape[0]):
        k = valid[b]
        outs.append(
            mmdet3d_get_target_single(
                boxes[b, k], labels[b, k], boxes_3d[b, k], labels_3d[b, k], centers2d[b, k],
                depths[b, k], attrs[b, k], points, ranges, num_points_per_lvl, **opts,
            )
        )  # fmt: skip
    return tuple(torch.stack(parts) for parts in zip(*outs))


# --------------------------------------------------------------------------------------------
# Scenes
# --------------------------------------------------------------------------------------------


def grid(width: int, height: int, device="cpu"):
    """mmdet's points (x * stride + stride // 2, level by level) and their per-point meta."""
    pts, counts = [], []
    for s in STRIDES:
        w, h = -(-width // s), -(-height // s)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pts.append(torch.stack((xs.reshape(-1) * s, ys.reshape(-1) * s), -1) + s // 2)
        counts.append(w * h)
    points = torch.cat(pts).float().to(device)
    strides, ranges = point_meta(counts, STRIDES, REGRESS_RANGES, device)
    return points, strides, ranges, counts


def gts(B, G, width, height, valid_p=0.8, seed=0, code=9):
    gen = torch.Generator().manual_seed(seed)
    xy1 = torch.rand(B, G, 2, generator=gen) * torch.tensor([width, height]) * 0.9
    wh = 8 + torch.rand(B, G, 2, generator=gen) * torch.tensor([width, height]) * 0.5
    boxes = torch.cat((xy1, xy1 + wh), -1)
    centers2d = xy1 + wh * (0.3 + 0.4 * torch.rand(B, G, 2, generator=gen))
    boxes_3d = torch.randn(B, G, code, generator=gen) * 3
    boxes_3d[..., 2] = boxes_3d[..., 2].abs() + 2  # z in front of the camera
    return (
        boxes,
        torch.randint(0, NUM_CLASSES, (B, G), generator=gen),
        boxes_3d,
        torch.randint(0, NUM_CLASSES, (B, G), generator=gen),
        centers2d,
        torch.rand(B, G, generator=gen) * 50 + 1,
        torch.randint(0, NUM_ATTRS, (B, G), generator=gen),
        torch.rand(B, G, generator=gen) < valid_p,
    )


def op(points, strides, ranges, g, **opts):
    return fcos3d_targets(
        points, strides, ranges, *g, background_label=NUM_CLASSES,
        attr_background_label=NUM_ATTRS, **opts,
    )  # fmt: skip


def assert_same(out, ref, exact_float=True) -> None:
    names = ("labels", "bbox_targets", "labels_3d", "bbox_targets_3d", "centerness", "attrs")
    for name, o, r in zip(names, out, ref):
        o = o.cpu()
        if o.dtype == torch.int64 or exact_float:
            assert torch.equal(o, r), f"{name}: first difference at {(o != r).nonzero()[:3]}"
        else:
            torch.testing.assert_close(o, r, rtol=2e-6, atol=2e-6, msg=name)


# --------------------------------------------------------------------------------------------
# Reference path (CPU)
# --------------------------------------------------------------------------------------------


def test_equals_mmdet3d_on_a_random_scene() -> None:
    points, strides, ranges, counts = grid(400, 232)
    g = gts(3, 12, 400, 232, seed=1)
    out = op(points, strides, ranges, g)
    assert_same(out, per_image_loop(points, counts, g))
    fg = out.labels != NUM_CLASSES
    assert fg.sum() > 20  # the scene has foreground on several levels
    assert (out.labels_3d[fg] < NUM_CLASSES).all() and (out.attr_labels[fg] < NUM_ATTRS).all()


@settings(max_examples=12, deadline=None)
@given(
    B=st.integers(1, 3),
    G=st.integers(0, 10),
    size=st.sampled_from([(64, 48), (200, 120), (257, 131)]),
    valid_p=st.sampled_from([0.0, 0.5, 1.0]),
    code=st.sampled_from([7, 9]),
    radius=st.sampled_from([1.5, 2.5]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_over_sizes(B, G, size, valid_p, code, radius, seed) -> None:
    points, strides, ranges, counts = grid(*size)
    g = gts(B, G, *size, valid_p=valid_p, seed=seed, code=code)
    out = op(points, strides, ranges, g, center_sample_radius=radius)
    assert_same(out, per_image_loop(points, counts, g, radius=radius))


def test_image_without_gts_is_background_with_zero_targets() -> None:
    points, strides, ranges, counts = grid(200, 120)
    g = gts(3, 5, 200, 120, valid_p=1.0, seed=2)
    g[-1][1] = False
    out = op(points, strides, ranges, g)
    assert_same(out, per_image_loop(points, counts, g))
    assert (out.labels[1] == NUM_CLASSES).all() and (out.attr_labels[1] == NUM_ATTRS).all()
    assert not out.bbox_targets[1].any() and not out.centerness[1].any()
    assert (out.labels[0] != NUM_CLASSES).any()


def test_gt_with_no_eligible_point_leaves_background_with_the_first_gts_targets() -> None:
    # One tiny gt whose centre square holds no point: every point is background, and (as in
    # mmdet3d) carries the targets of the image's first valid gt.
    points, strides, ranges, counts = grid(128, 64)
    g = list(gts(1, 3, 128, 64, valid_p=1.0, seed=3))
    g[4][0] = torch.tensor([[-500.0, -500.0], [-600.0, -600.0], [-700.0, -700.0]])
    g[-1][0, 0] = False  # the first valid gt is gt 1
    out = op(points, strides, ranges, tuple(g))
    assert_same(out, per_image_loop(points, counts, tuple(g)))
    assert (out.labels == NUM_CLASSES).all()
    expect = points[:, 0] - g[0][0, 1, 0]
    assert torch.equal(out.bbox_targets[0, :, 0], expect)


def test_contested_points_take_the_nearest_then_the_lowest_index() -> None:
    points, strides, ranges, counts = grid(256, 128)
    g = list(gts(2, 6, 256, 128, valid_p=1.0, seed=4))
    g[0][0] = torch.tensor([60.0, 30.0, 140.0, 100.0]).expand(6, 4)  # same boxes
    g[4][0] = torch.tensor([100.0, 64.0]).expand(6, 2)  # same centres: exact distance ties
    g[4][1, :3] = g[4][1, :3].round()
    out = op(points, strides, ranges, tuple(g))
    assert_same(out, per_image_loop(points, counts, tuple(g)))
    fg = out.labels[0] != NUM_CLASSES
    assert fg.any()
    assert (out.labels[0, fg] == g[1][0, 0]).all()  # gt 0 wins every tie


def test_one_gt_and_its_regress_range() -> None:
    points, strides, ranges, counts = grid(400, 232)
    g = gts(2, 1, 400, 232, valid_p=1.0, seed=5)
    out = op(points, strides, ranges, g)
    assert_same(out, per_image_loop(points, counts, g))
    fg = out.labels != NUM_CLASSES
    far = out.bbox_targets.max(-1).values
    assert ((far >= ranges[:, 0]) & (far <= ranges[:, 1]))[fg].all()
    assert (out.centerness[fg] > 0).all() and (out.centerness[fg] <= 1).all()


def test_point_meta_lays_out_levels() -> None:
    s, r = point_meta([3, 2], [8, 16], [(-1, 48), (48, 96)])
    assert s.tolist() == [8, 8, 8, 16, 16]
    assert r.tolist() == [[-1, 48]] * 3 + [[48, 96]] * 2
    with pytest.raises(ValueError, match="one entry per level"):
        point_meta([3], [8, 16], [(-1, 48)])


def _inputs(**changes):
    points, strides, ranges, _ = grid(64, 32)
    names = (
        "points", "point_strides", "regress_ranges", "gt_bboxes", "gt_labels", "gt_bboxes_3d",
        "gt_labels_3d", "centers2d", "depths", "attr_labels", "gt_valid",
    )  # fmt: skip
    args = dict(zip(names, (points, strides, ranges, *gts(2, 3, 64, 32))))
    opts = {"background_label": 10, "attr_background_label": 9}
    for k, v in changes.items():
        (args if k in args else opts)[k] = v(args[k]) if callable(v) else v
    return args, opts


@pytest.mark.parametrize(
    ("changes", "exc", "match"),
    [
        ({"points": lambda t: t[:, :1]}, ValueError, "points must be"),
        ({"points": lambda t: t.double()}, TypeError, "points has dtype"),
        ({"point_strides": lambda t: t[1:]}, ValueError, "point_strides must be"),
        ({"regress_ranges": lambda t: t[:, :1]}, ValueError, "regress_ranges must be"),
        ({"gt_bboxes": lambda t: t[..., :3]}, ValueError, "gt_bboxes must be"),
        ({"gt_labels": lambda t: t.int()}, TypeError, "gt_labels has dtype"),
        ({"gt_bboxes_3d": lambda t: t[..., :6]}, ValueError, "gt_bboxes_3d must be"),
        ({"centers2d": lambda t: t[:1]}, ValueError, "centers2d must be"),
        ({"depths": lambda t: t[..., None]}, ValueError, "depths must be"),
        ({"attr_labels": lambda t: t[:, :2]}, ValueError, "attr_labels must be"),
        ({"gt_valid": lambda t: t.float()}, TypeError, "gt_valid has dtype"),
        ({"gt_valid": "x"}, TypeError, "gt_valid must be a tensor"),
        ({"background_label": 1.0}, TypeError, "background_label must be an int"),
        ({"center_sample_radius": -1.0}, ValueError, "center_sample_radius must be positive"),
        ({"centerness_alpha": "2"}, TypeError, "centerness_alpha must be a number"),
    ],
)
def test_bad_arguments_are_named(changes, exc, match) -> None:
    args, opts = _inputs(**changes)
    with pytest.raises(exc, match=match):
        fcos3d_targets(**args, **opts)


def test_opcheck() -> None:
    args, opts = _inputs()
    torch.library.opcheck(
        torch.ops.aiak.fcos3d_targets.default,
        (*args.values(), opts["background_label"], opts["attr_background_label"], 1.5, 2.5),
    )


# --------------------------------------------------------------------------------------------
# CUDA kernel
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("B", "G", "width", "height", "valid_p"),
    [(3, 12, 400, 232, 0.8), (2, 0, 200, 120, 1.0), (8, 50, 1600, 928, 0.7), (1, 1, 64, 48, 1.0)],
)
def test_cuda_kernel_equals_the_reference(B, G, width, height, valid_p) -> None:
    import aiak.ops

    assert aiak.ops.backends()["ops"]["fcos3d_targets"] == "cupy"
    points, strides, ranges, _ = grid(width, height)
    g = gts(B, G, width, height, valid_p=valid_p, seed=B + G)
    ref = op(points, strides, ranges, g)
    out = op(points.cuda(), strides.cuda(), ranges.cuda(), tuple(t.cuda() for t in g))
    assert out.labels.is_cuda
    # labels and the 2D targets are bit-identical; yaw (atan2) and centerness (exp) may differ
    # from the host's libm in the last bit
    assert_same(out, ref, exact_float=False)
    for i in (0, 1, 2, 5):
        assert torch.equal(out[i].cpu(), ref[i])


@pytest.mark.cuda
def test_cuda_kernel_does_not_synchronise_the_host() -> None:
    points, strides, ranges, _ = grid(1600, 928, "cuda")
    g = tuple(t.cuda() for t in gts(8, 50, 1600, 928, seed=7))
    op(points, strides, ranges, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = op(points, strides, ranges, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (out.labels != NUM_CLASSES).sum().item() > 0


@pytest.mark.cuda
def test_cuda_opcheck() -> None:
    args, opts = _inputs()
    torch.library.opcheck(
        torch.ops.aiak.fcos3d_targets.default,
        (*(t.cuda() for t in args.values()), opts["background_label"],
         opts["attr_background_label"], 1.5, 2.5),
    )  # fmt: skip
