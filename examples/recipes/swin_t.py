"""Swin-T training: timm ``swin_tiny_patch4_window7_224`` with aiak's window attention
(``aiak.ops.swin.convert``), O2 (``aiak.amp.decorate``) and ``FusedAdamW``.

    python examples/recipes/swin_t.py [--steps 20] [--compile] [--no-aiak] [--batch 64]
    aiakrun -np 8 -- python examples/recipes/swin_t.py --compile
    python examples/recipes/swin_t.py --compile --compile-mode reduce-overhead   # CUDA graphs
    python examples/recipes/swin_t.py --cuda-graphs   # eager model, forward + backward graphed
    aiakrun -np 8 -- python examples/recipes/swin_t.py --cuda-graphs   # graphed, then DDP
    python examples/recipes/swin_t.py --tiny --device cpu    # no timm: a small torch.nn Swin

``--no-aiak``: timm's model under torch.autocast with torch's fused AdamW (O1), the baseline.
Synthetic ImageNet-shaped data (random images, random labels): the step is what is measured.
"""

from __future__ import annotations

import small_models
import torch
from _recipe import Run, half_dtype, main, scaler_for
from torch.nn import functional as F


def _model(tiny: bool) -> torch.nn.Module:
    if tiny:
        return small_models.SwinLike(dim=32, heads=2, res=8, ws=4, depth=1, classes=10)
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", num_classes=1000)


def build(aiak: bool, tiny: bool, device: torch.device, batch: int) -> Run:
    torch.manual_seed(0)
    model = _model(tiny).to(device)
    size, classes = (32, 10) if tiny else (224, 1000)
    g = torch.Generator(device=device).manual_seed(1)
    images = torch.randn(batch, 3, size, size, device=device, generator=g)
    labels = torch.randint(0, classes, (batch,), device=device, generator=g)
    if aiak:
        import aiak.amp
        from aiak.ops import swin
        from aiak.optim import FusedAdamW

        swin.convert(model)
        opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        aiak.amp.decorate(model, opt, dtype=half_dtype(device))
    else:
        fused = device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=fused)
    return Run(
        model=model,
        optimizer=opt,
        next_batch=lambda: (images, labels),
        loss_fn=lambda fwd, b: F.cross_entropy(fwd(b[0]), b[1]),
        device=device,
        scaler=scaler_for(device, aiak),
    )


if __name__ == "__main__":
    main(build, __doc__.split("\n")[0], batch=64, tiny_batch=4)
