"""Models and inputs shared by the compile tests: the recipes' torch.nn-only models
(examples/recipes/small_models.py), so no test needs timm or torchvision."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))

import small_models  # noqa: E402

BF16 = torch.bfloat16


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``(model, inputs, labels)`` for ``name`` in MODELS, fp32, small enough for CPU."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "resnet":
        model = small_models.ResNetLike((8, 16))
        x = torch.randn(8, 3, 16, 16, generator=g)
    elif name == "encoder":
        model = small_models.encoder(32, 2, 2)
        x = torch.randint(0, 100, (8, 12), generator=g)
    elif name in ("swin", "swin_convert"):
        model = small_models.SwinLike(dim=32, heads=2, res=8, ws=4)
        x = torch.randn(4, 3, 32, 32, generator=g)
        if name == "swin_convert":
            from aiak.ops import swin

            swin.convert(model)
    else:
        raise ValueError(name)
    y = torch.randint(0, 10, (x.shape[0],), generator=g)
    return model, x, y


MODELS = ("resnet", "encoder", "swin", "swin_convert")
