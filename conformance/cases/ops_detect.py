"""Conformance of the detection label-assignment ops: ``aiak::simota_assign`` and
``aiak::fcos3d_targets``.

The reference is each op's PyTorch implementation run on CPU (SimOTA computes its costs in
float64 there; FCOS3D follows mmdet3d's float32 operations); the candidate runs on the device
at hand. Assignments (masks, indices, labels, counts) must match exactly; float outputs are
compared under the fp32 policy (atan2/exp/log may differ from the host's libm in the last bit).
The baselines are the per-image loops a user runs today, timed with ``--bench``.
"""

from __future__ import annotations

from typing import Any

import torch

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register
from aiak.ops.fcos3d import _reference as _fcos_ref
from aiak.ops.simota import _reference as _simota_ref

# --------------------------------------------------------------------------------------------
# SimOTA
# --------------------------------------------------------------------------------------------

_SIMOTA_SIZES = (
    # label, B, G, image size, C, fraction of valid gts, extra
    ("tiny 2x3 img64", 2, 3, 64, 4, 1.0, {}),
    ("padded 4x12 img320", 4, 12, 320, 20, 0.6, {}),
    ("no gts 2x5", 2, 5, 64, 3, 0.0, {}),
    ("YOLOX 16x12 8400 anchors", 16, 12, 640, 80, 1.0, {"cuda": True, "bench": True}),
    ("YOLOX 16x50 8400 anchors", 16, 50, 640, 80, 0.8, {"cuda": True}),
)
_MODES = {
    "classic": (2.5, False, True),
    "center": (1.5, True, True),
    "yolov7": (2.5, False, False),
}


def _anchors(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    centers, strides = [], []
    for s in (8, 16, 32):
        n = size // s
        ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        centers.append(torch.stack([(xs.flatten() + 0.5) * s, (ys.flatten() + 0.5) * s], 1))
        strides.append(torch.full((n * n,), float(s)))
    return torch.cat(centers).float().to(device), torch.cat(strides).to(device)


def _simota_specs(device: torch.device) -> list[Spec]:
    specs = []
    for mode in _MODES:
        for label, B, G, size, C, valid_p, extra in _SIMOTA_SIZES:
            if extra.get("cuda") and device.type != "cuda":
                continue
            params = {"B": B, "G": G, "size": size, "C": C, "valid_p": valid_p, "mode": mode}
            specs.append(
                Spec(f"{mode} {label}", torch.float32, params, bench=bool(extra.get("bench")))
            )
    return specs


def _simota_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    B, G, size, C = p["B"], p["G"], p["size"], p["C"]
    centers, strides = _anchors(size, torch.device("cpu"))
    A = centers.shape[0]
    xy = torch.rand(B, G, 2, generator=gen) * size
    wh = 4 + torch.rand(B, G, 2, generator=gen) * (size / 3)
    gt = torch.cat([xy, wh], -1)
    classes = torch.randint(0, C, (B, G), generator=gen)
    valid = torch.rand(B, G, generator=gen) < p["valid_p"]
    if G:
        src = torch.randint(0, G, (B, A), generator=gen)
        pred = gt.gather(1, src[..., None].expand(B, A, 4)).clone()
    else:
        pred = torch.cat([centers.expand(B, A, 2), torch.full((B, A, 2), 8.0)], -1)
    pred += torch.randn(B, A, 4, generator=gen) * 4
    pred[..., 2:] = pred[..., 2:].abs() + 1
    cpu = (
        gt, classes, valid, centers, strides, pred,
        torch.randn(B, A, C, generator=gen) * 2, torch.randn(B, A, generator=gen) * 2,
    )  # fmt: skip
    return {"cpu": cpu, "dev": tuple(t.to(device) for t in cpu), "mode": _MODES[p["mode"]]}


_SIMOTA_KEYS = ("fg_mask", "matched_gt", "matched_iou", "num_fg")


def _simota_reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = torch.ops.aiak.simota_assign(*inp["cpu"], *inp["mode"], "cxcywh")
    return dict(zip(_SIMOTA_KEYS, out))


def _simota_candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = torch.ops.aiak.simota_assign(*inp["dev"], *inp["mode"], "cxcywh")
    return dict(zip(_SIMOTA_KEYS, out))


def _simota_baseline(inp: dict[str, Any]) -> None:
    """Stock PyTorch the way YOLOX's loss runs it: the PyTorch reference once per image, gts
    sliced by a host-read index (a synchronisation per image, as YOLOX's ``int(nlabel[b])``)."""
    gt, classes, valid, centers, strides, pred, cls, obj = inp["dev"]
    for b in range(gt.shape[0]):
        keep = valid[b].nonzero().squeeze(1)
        _simota_ref(
            gt[b : b + 1, keep], classes[b : b + 1, keep], valid[b : b + 1, keep], centers,
            strides, pred[b : b + 1], cls[b : b + 1], obj[b : b + 1], *inp["mode"], "cxcywh",
        )  # fmt: skip


register(
    Case(
        name="ops.simota_assign",
        specs=_simota_specs,
        make_inputs=_simota_inputs,
        candidate=_simota_candidate,
        reference=_simota_reference,
        baseline=_simota_baseline,
        exact=("fg_mask", "matched_gt", "num_fg"),
        description="SimOTA assignment over a padded batch (YOLOX classic / centre-only / "
        "YOLOv7 cost) vs the CPU float64 reference; masks, indices and counts exact; "
        "baseline: the PyTorch reference once per image with host-read gt indices",
    )
)

# --------------------------------------------------------------------------------------------
# FCOS3D
# --------------------------------------------------------------------------------------------

_FCOS_STRIDES = (8, 16, 32, 64, 128)
_FCOS_RANGES = ((-1, 48), (48, 96), (96, 192), (192, 384), (384, 1e8))
_FCOS_SIZES = (
    ("tiny 2x3 200x120", 2, 3, 200, 120, 1.0, {}),
    ("padded 3x12 400x232", 3, 12, 400, 232, 0.6, {}),
    ("no gts 2x4", 2, 4, 200, 120, 0.0, {}),
    ("nuScenes 8x50 1600x928", 8, 50, 1600, 928, 0.8, {"cuda": True, "bench": True}),
)


def _fcos_specs(device: torch.device) -> list[Spec]:
    return [
        Spec(
            label,
            torch.float32,
            {"B": B, "G": G, "w": w, "h": h, "valid_p": vp},
            bench=bool(extra.get("bench")),
        )
        for label, B, G, w, h, vp, extra in _FCOS_SIZES
        if not (extra.get("cuda") and device.type != "cuda")
    ]


def _fcos_inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    from aiak.ops.fcos3d import point_meta

    p = spec.params
    B, G, w, h = p["B"], p["G"], p["w"], p["h"]
    pts, counts = [], []
    for s in _FCOS_STRIDES:
        nw, nh = -(-w // s), -(-h // s)
        ys, xs = torch.meshgrid(torch.arange(nh), torch.arange(nw), indexing="ij")
        pts.append(torch.stack((xs.reshape(-1) * s, ys.reshape(-1) * s), -1) + s // 2)
        counts.append(nw * nh)
    points = torch.cat(pts).float()
    strides, ranges = point_meta(counts, _FCOS_STRIDES, _FCOS_RANGES)
    xy1 = torch.rand(B, G, 2, generator=gen) * torch.tensor([w, h]) * 0.9
    wh = 8 + torch.rand(B, G, 2, generator=gen) * torch.tensor([w, h]) * 0.4
    boxes_3d = torch.randn(B, G, 9, generator=gen) * 3
    cpu = (
        points, strides, ranges, torch.cat((xy1, xy1 + wh), -1),
        torch.randint(0, 10, (B, G), generator=gen), boxes_3d,
        torch.randint(0, 10, (B, G), generator=gen),
        xy1 + wh * (0.3 + 0.4 * torch.rand(B, G, 2, generator=gen)),
        torch.rand(B, G, generator=gen) * 50 + 1, torch.randint(0, 9, (B, G), generator=gen),
        torch.rand(B, G, generator=gen) < p["valid_p"],
    )  # fmt: skip
    return {"cpu": cpu, "dev": tuple(t.to(device) for t in cpu), "counts": counts}


_FCOS_KEYS = ("labels", "bbox_targets", "labels_3d", "bbox_targets_3d", "centerness", "attrs")


def _fcos_reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(zip(_FCOS_KEYS, torch.ops.aiak.fcos3d_targets(*inp["cpu"], 10, 9, 1.5, 2.5)))


def _fcos_candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(zip(_FCOS_KEYS, torch.ops.aiak.fcos3d_targets(*inp["dev"], 10, 9, 1.5, 2.5)))


def _fcos_baseline(inp: dict[str, Any]) -> None:
    """Stock PyTorch once per image: the PyTorch reference on each image's valid gts, sliced
    by a host-read index (mmdet3d's loop; its ``range(P)`` gathers are in bench_detect.py)."""
    t = inp["dev"]
    valid = t[10]
    for b in range(valid.shape[0]):
        keep = valid[b].nonzero().squeeze(1)
        per_image = [x[b : b + 1, keep] for x in t[3:]]
        _fcos_ref(*t[:3], *per_image, 10, 9, 1.5, 2.5)


register(
    Case(
        name="ops.fcos3d_targets",
        specs=_fcos_specs,
        make_inputs=_fcos_inputs,
        candidate=_fcos_candidate,
        reference=_fcos_reference,
        baseline=_fcos_baseline,
        exact=("labels", "labels_3d", "attrs", "bbox_targets"),
        description="FCOS3D point targets over a padded batch (mmdet3d semantics) vs the CPU "
        "reference; labels and 2D targets exact, 3D targets and centerness at fp32 policy; "
        "baseline: the PyTorch reference once per image with host-read gt indices",
    )
)
