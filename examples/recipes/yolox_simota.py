"""A YOLOX-style detector (a small conv backbone, strides 8 and 16, and a decoupled head)
trained with the YOLOX loss, its label assignment by ``aiak.ops.simota_assign`` for the whole
batch in one call, against YOLOX's per-image ``get_assignments`` loop.

    python examples/recipes/yolox_simota.py [--steps 20] [--compile] [--no-aiak] [--batch 64]
    aiakrun -np 8 -- python examples/recipes/yolox_simota.py
    python examples/recipes/yolox_simota.py --tiny --device cpu

``--no-aiak``: the per-image loop (YOLOX's own assignment, written out in
tests/examples/test_yolox_example.py) under torch.autocast with torch's SGD, the baseline.
With ``--aiak`` the loss of examples/yolox_loss_simota.py, O2 and ``FusedSGD``. The loss is
computed in fp32 on the model's fp32 outputs either way. ``--compile`` compiles the model;
the per-image loop reads each image's label count on the host and stays eager.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import small_models
import torch
from _recipe import Run, half_dtype, main, scaler_for

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(aiak: bool, tiny: bool, device: torch.device, batch: int) -> Run:
    torch.manual_seed(0)
    size, classes, gts, width = (64, 4, 6, 8) if tiny else (640, 80, 12, 32)
    model = small_models.TinyDetector(classes, width).to(device)
    centers, strides = model.anchors(size, size, device)
    example = _load("yolox_loss_simota", ROOT / "examples" / "yolox_loss_simota.py")
    g = torch.Generator().manual_seed(1)
    labels, _ = example.batch(batch, gts, size, classes, g, device)
    images = torch.randn(batch, 3, size, size, generator=g).to(device)
    if aiak:
        import aiak.amp
        from aiak.optim import FusedSGD

        opt = FusedSGD(model.parameters(), lr=0.01, momentum=0.9)
        aiak.amp.decorate(model, opt, dtype=half_dtype(device))

        def loss_fn(fwd, b):
            out = fwd(b[0]).float()
            with torch.autocast(device.type, enabled=False):
                return example.yolox_loss(out, b[1], centers, strides)["total"]

    else:
        loop = _load("yolox_loop", ROOT / "tests" / "examples" / "test_yolox_example.py")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)

        def loss_fn(fwd, b):
            out = fwd(b[0]).float()
            with torch.autocast(device.type, enabled=False):
                return loop.yolox_loop_loss(out, b[1], centers, strides, torch.float32)

    return Run(
        model=model,
        optimizer=opt,
        next_batch=lambda: (images, labels),
        loss_fn=loss_fn,
        device=device,
        scaler=scaler_for(device, aiak),
    )


if __name__ == "__main__":
    main(build, __doc__.split("\n")[0], batch=64, tiny_batch=4)
