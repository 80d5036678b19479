"""A YOLOX-style loss with the batched SimOTA op in place of YOLOX's per-image loop.

YOLOX's ``get_losses`` calls ``get_assignments`` once per image and reads each image's gt count
on the host; here one ``aiak.ops.simota_assign`` call assigns the whole batch and every loss is
computed densely with the foreground mask as a weight, so the step never waits for the GPU.

    python examples/yolox_loss_simota.py [--device cuda] [--steps 30]

Inputs as YOLOX has them: ``outputs`` [B, A, 5 + C] (decoded cx, cy, w, h in pixels, objectness
logit, class logits), ``labels`` [B, G, 5] (class, cx, cy, w, h; all-zero rows are padding).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from aiak.ops import simota_assign


def iou_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """YOLOX's IOUloss (``1 - iou**2``) elementwise over [..., 4] cxcywh boxes."""
    tl = torch.max(pred[..., :2] - pred[..., 2:] / 2, target[..., :2] - target[..., 2:] / 2)
    br = torch.min(pred[..., :2] + pred[..., 2:] / 2, target[..., :2] + target[..., 2:] / 2)
    inter = (br - tl).clamp(min=0).prod(-1)
    union = pred[..., 2:].prod(-1) + target[..., 2:].prod(-1) - inter
    return 1 - (inter / (union + 1e-16)) ** 2


def yolox_loss(
    outputs: torch.Tensor,
    labels: torch.Tensor,
    anchor_centers: torch.Tensor,
    anchor_strides: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """YOLOX's loss terms (iou x5, obj, cls) over the batch, SimOTA by one op call."""
    C = outputs.shape[-1] - 5
    boxes, obj, cls = outputs[..., :4], outputs[..., 4], outputs[..., 5:]
    valid = labels.sum(-1) > 0
    with torch.no_grad():  # YOLOX assigns on detached predictions
        a = simota_assign(
            labels[..., 1:5], labels[..., 0].long(), valid, anchor_centers, anchor_strides,
            boxes.detach(), cls.detach(), obj.detach(),
        )  # fmt: skip
    fg = a.fg_mask.float()
    num_fg = a.num_fg.sum().clamp(min=1)  # a tensor: no .item()
    idx = a.matched_gt.clamp(min=0)  # background rows gather gt 0 and are weighted by 0
    reg_target = labels[..., 1:5].gather(1, idx[..., None].expand(*idx.shape, 4))
    cls_target = F.one_hot(labels[..., 0].long().gather(1, idx), C).float()
    cls_target = cls_target * a.matched_iou[..., None]
    loss_iou = (iou_loss(boxes, reg_target) * fg).sum() / num_fg
    loss_obj = F.binary_cross_entropy_with_logits(obj, fg, reduction="sum") / num_fg
    loss_cls = (
        F.binary_cross_entropy_with_logits(cls, cls_target, reduction="none").sum(-1) * fg
    ).sum() / num_fg
    total = 5.0 * loss_iou + loss_obj + loss_cls
    return {"total": total, "iou": loss_iou, "obj": loss_obj, "cls": loss_cls, "num_fg": num_fg}


class TinyHead(torch.nn.Module):
    """A stand-in detector head: per-anchor learned offsets + logits (enough to train on)."""

    def __init__(self, anchors: torch.Tensor, strides: torch.Tensor, num_classes: int) -> None:
        super().__init__()
        self.register_buffer("anchors", anchors)
        self.register_buffer("strides", strides)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5 + num_classes)
        )

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        B, A = image_features.shape[0], self.anchors.shape[0]
        pos = torch.cat([self.anchors / 64, self.strides[:, None] / 32], -1).expand(B, A, 3)
        raw = self.net(torch.cat([pos, image_features[:, None, :5].expand(B, A, 5)], -1))
        xy = self.anchors + raw[..., :2] * self.strides[:, None]
        wh = torch.exp(raw[..., 2:4].clamp(max=6)) * self.strides[:, None]
        return torch.cat([xy, wh, raw[..., 4:]], -1)


def anchors_for(size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    centers, strides = [], []
    for s in (8, 16, 32):
        n = size // s
        ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        centers.append(torch.stack([(xs.flatten() + 0.5) * s, (ys.flatten() + 0.5) * s], 1))
        strides.append(torch.full((n * n,), float(s)))
    return torch.cat(centers).float().to(device), torch.cat(strides).to(device)


def batch(B: int, G: int, size: int, C: int, gen: torch.Generator, device) -> tuple:
    """Random labels (padded with zero rows) and per-image features describing them."""
    n = torch.randint(0, G + 1, (B,), generator=gen)
    xy = torch.rand(B, G, 2, generator=gen) * size
    wh = 8 + torch.rand(B, G, 2, generator=gen) * size / 3
    cls = torch.randint(0, C, (B, G, 1), generator=gen).float()
    labels = torch.cat([cls, xy, wh], -1) * (torch.arange(G)[None, :, None] < n[:, None, None])
    feats = torch.randn(B, 8, generator=gen)
    return labels.to(device), feats.to(device)


def train(device: str = "cpu", steps: int = 30, B: int = 4, size: int = 64) -> list[float]:
    """Train the tiny head a few steps on fixed random data; returns the loss per step."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    C, G = 5, 6
    centers, strides = anchors_for(size, device)
    head = TinyHead(centers, strides, C).to(device)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    labels, feats = batch(B, G, size, C, gen, device)
    losses = []
    for _ in range(steps):
        loss = yolox_loss(head(feats), labels, centers, strides)["total"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))  # logging only; the step itself never syncs
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    losses = train(args.device, args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
