"""ResNet-50 training: torchvision ``resnet50`` (channels_last) with batch norm + (add +) ReLU
fused (``aiak.ops.resnet.convert``), O2 (``aiak.amp.decorate``), ``FusedSGD``, and
``aiak.data.CudaPrefetcher`` copying uint8 images on a side stream and normalising them on the
GPU (4x fewer bytes cross PCIe than float images).

    python examples/recipes/resnet50.py [--steps 20] [--compile] [--no-aiak] [--batch 128]
    aiakrun -np 8 -- python examples/recipes/resnet50.py --compile
    python examples/recipes/resnet50.py --tiny --device cpu   # no torchvision: a small ResNet

``--no-aiak``: the model under torch.autocast with torch's SGD (foreach), images copied and
normalised in the step, the baseline. Synthetic uint8 images in pinned host memory, a new
batch each step (a fixed pool, cycled).
"""

from __future__ import annotations

import itertools

import small_models
import torch
from _recipe import Run, half_dtype, main, scaler_for
from torch.nn import functional as F

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _model(tiny: bool) -> torch.nn.Module:
    if tiny:
        return small_models.ResNetLike((8, 16), classes=10)
    import torchvision

    return torchvision.models.resnet50(num_classes=1000)


def build(aiak: bool, tiny: bool, device: torch.device, batch: int) -> Run:
    torch.manual_seed(0)
    model = _model(tiny).to(device, memory_format=torch.channels_last)
    size, classes = (16, 10) if tiny else (224, 1000)
    g = torch.Generator().manual_seed(1)
    pin = device.type == "cuda"
    pool = [
        (
            torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(4)
    ]
    if pin:
        pool = [(x.pin_memory(), y.pin_memory()) for x, y in pool]
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    if aiak:
        import aiak.amp
        from aiak.data import CudaPrefetcher, normalize
        from aiak.ops import resnet
        from aiak.optim import FusedSGD

        resnet.convert(model)
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        aiak.amp.decorate(model, opt, dtype=half_dtype(device))
        batches = iter(
            CudaPrefetcher(
                _Cycle(pool), device=device, transform=normalize(MEAN, STD, dtype=torch.float32)
            )
        )

        def next_batch():
            x, y = next(batches)
            return x.contiguous(memory_format=torch.channels_last), y

    else:
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True
        )
        cycle = itertools.cycle(pool)

        def next_batch():
            x, y = next(cycle)
            x = x.to(device, non_blocking=True).float().sub_(mean).div_(std)
            return x.contiguous(memory_format=torch.channels_last), y.to(device, non_blocking=True)

    return Run(
        model=model,
        optimizer=opt,
        next_batch=next_batch,
        loss_fn=lambda fwd, b: F.cross_entropy(fwd(b[0]), b[1]),
        device=device,
        scaler=scaler_for(device, aiak),
    )


class _Cycle:
    """An endless loader over a fixed pool of host batches (the prefetcher iterates it once)."""

    def __init__(self, pool: list) -> None:
        self.pool = pool

    def __iter__(self):
        return itertools.cycle(self.pool)


if __name__ == "__main__":
    main(build, __doc__.split("\n")[0], batch=128, tiny_batch=8)
