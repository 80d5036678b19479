"""aiak-advise scenario on a GPU: a GPU-bound O1 step (torch.autocast fp16 + GradScaler) with
torch's SGD (foreach), whose host waits for the GPU in GradScaler.step's ``.item()``.

Wide matmuls with a LayerNorm (on autocast's fp32 list) between them; plain torch. On the CPU
(``--device cpu``, a smoke run) autocast is bf16 and there is no GradScaler.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)
    w = args.width
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(w, w), nn.LayerNorm(w), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(w, 10)).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    cuda = args.device.startswith("cuda")
    scaler = torch.amp.GradScaler("cuda") if cuda else None
    half = torch.float16 if cuda else torch.bfloat16
    x = torch.randn(args.batch, w, device=args.device)
    y = torch.randint(0, 10, (args.batch,), device=args.device)
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(args.device).type, dtype=half):
            loss = nn.functional.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
