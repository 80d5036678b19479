"""aiak-advise scenario, data-bound: a dataset that waits on (simulated) storage.

Each item sleeps ``--item-ms`` (a storage read, simulated) and an epoch is two batches, read by
a plain ``DataLoader`` with two workers: every epoch starts its workers again and waits for its
first batch, and the model's step is tiny. Plain torch.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __init__(self, n: int, item_s: float) -> None:
        self.n, self.item_s = n, item_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.item_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--item-ms", type=float, default=15.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(Slow(8, args.item_ms / 1e3), batch_size=4, num_workers=2)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
