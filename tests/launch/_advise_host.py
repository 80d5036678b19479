"""aiak-advise scenario, host-bound: a small model whose step is the cost of its ops.

One 8x8 linear layer applied 60 times to a batch of 2: hundreds of ops per step, each with
almost no work, and two parameters for the optimizer. Plain torch.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Deep(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(self.layer(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Deep(60).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(2, 8, device=args.device), torch.randn(2, 8, device=args.device)
    for _ in range(args.steps):
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
