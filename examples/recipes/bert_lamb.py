"""A BERT-base-sized encoder (12 layers, 768 wide, 12 heads, sequence 128) from torch.nn at a
large batch, trained with aiak's LAMB and O2.

    python examples/recipes/bert_lamb.py [--steps 20] [--compile] [--no-aiak] [--batch 256]
    aiakrun -np 8 -- python examples/recipes/bert_lamb.py --batch 512
    python examples/recipes/bert_lamb.py --tiny --device cpu

``--no-aiak``: torch.autocast (O1) with torch's fused AdamW (torch has no LAMB), the baseline a
user has; LAMB is what keeps large-batch training converging (examples/lamb_digits.py).
Synthetic token ids with a learnable rule (the label is the first token's id modulo the
classes), so the loss falls.
"""

from __future__ import annotations

import small_models
import torch
from _recipe import Run, half_dtype, main, scaler_for
from torch.nn import functional as F


def build(aiak: bool, tiny: bool, device: torch.device, batch: int) -> Run:
    torch.manual_seed(0)
    dim, heads, layers, seq, vocab = (32, 2, 2, 16, 100) if tiny else (768, 12, 12, 128, 30522)
    classes = 10
    model = small_models.encoder(dim, heads, layers, vocab, classes).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
    labels = tokens[:, 0] % classes
    if aiak:
        import aiak.amp
        from aiak.optim import LAMB

        opt = LAMB(model.parameters(), lr=2e-3, weight_decay=0.01)
        aiak.amp.decorate(model, opt, dtype=half_dtype(device))
    else:
        fused = device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01, fused=fused)
    return Run(
        model=model,
        optimizer=opt,
        next_batch=lambda: (tokens, labels),
        loss_fn=lambda fwd, b: F.cross_entropy(fwd(b[0]), b[1]),
        device=device,
        scaler=scaler_for(device, aiak),
    )


if __name__ == "__main__":
    main(build, __doc__.split("\n")[0], batch=256, tiny_batch=8)
