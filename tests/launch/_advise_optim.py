"""aiak-advise scenario, optimizer-bound: many small parameters and torch's Adam.

Four hundred 16-element parameters and a forward of one multiply-add each way: the step is
the optimizer's per-tensor loop. Plain torch; the number of steps comes from ``--steps``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(16) / 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(list(self.w))  # one op over every tensor
        return x @ stacked.t()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Many(400).to(args.device)
    # the per-tensor loop: torch's default on CPU, asked for on a GPU (whose default is foreach)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 16, device=args.device)
    for _ in range(args.steps):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
