"""examples/yolox_loss_simota.py: the batched-SimOTA loss equals YOLOX's per-image loss and
trains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load("yolox_example", ROOT / "examples" / "yolox_loss_simota.py")
literal = _load("simota_literal", ROOT / "tests" / "ops" / "test_simota.py")


def yolox_loop_loss(outputs, labels, centers, strides, dtype=torch.float64):
    """YOLOX's get_losses: per image, the literal get_assignments, targets by boolean indexing,
    then the losses over the concatenated foreground (``dtype=torch.float32``: YOLOX as it
    runs, timed by benchmarks/bench_detect.py)."""
    C = outputs.shape[-1] - 5
    reg_t, cls_t, obj_t, fg_t = [], [], [], []
    nlabel = (labels.sum(dim=2) > 0).sum(dim=1)
    num_fg = 0
    for b in range(outputs.shape[0]):
        n = int(nlabel[b])
        A = outputs.shape[1]
        if n == 0:
            cls_t.append(outputs.new_zeros((0, C)))
            reg_t.append(outputs.new_zeros((0, 4)))
            obj_t.append(outputs.new_zeros((A, 1)))
            fg_t.append(torch.zeros(A, dtype=torch.bool, device=outputs.device))
            continue
        gt = labels[b, :n]
        fg, matched, ious = literal.yolox_get_assignments(
            gt[:, 1:5], gt[:, 0].long(), centers, strides, outputs[b, :, :4].detach(),
            outputs[b, :, 5:].detach(), outputs[b, :, 4].detach(), dtype=dtype,
        )  # fmt: skip
        num_fg += int(fg.sum())
        cls_t.append(F.one_hot(gt[matched[fg], 0].long(), C).float() * ious[fg, None])
        reg_t.append(gt[matched[fg], 1:5])
        obj_t.append(fg[:, None].float())
        fg_t.append(fg)
    fg = torch.cat(fg_t)
    num_fg = max(num_fg, 1)
    flat = outputs.reshape(-1, outputs.shape[-1])
    loss_iou = example.iou_loss(flat[fg, :4], torch.cat(reg_t)).sum() / num_fg
    loss_obj = (
        F.binary_cross_entropy_with_logits(flat[:, 4:5], torch.cat(obj_t), reduction="sum") / num_fg
    )
    loss_cls = (
        F.binary_cross_entropy_with_logits(flat[fg, 5:], torch.cat(cls_t), reduction="sum") / num_fg
    )
    return 5.0 * loss_iou + loss_obj + loss_cls


def test_op_loss_equals_the_per_image_yolox_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    centers, strides = example.anchors_for(64, "cpu")
    head = example.TinyHead(centers, strides, 5)
    labels, feats = example.batch(4, 6, 64, 5, gen, "cpu")
    labels[1] = 0  # one image without labels
    outputs = head(feats)
    ours = example.yolox_loss(outputs, labels, centers, strides)
    ref = yolox_loop_loss(outputs, labels, centers, strides)
    assert ours["num_fg"] > 0
    torch.testing.assert_close(ours["total"], ref, rtol=1e-5, atol=1e-6)


def test_example_trains_on_cpu() -> None:
    losses = example.train("cpu", steps=25)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0]
