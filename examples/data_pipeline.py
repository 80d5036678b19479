"""A variable-length input pipeline with aiak.data: balanced length-grouped batches, workers
kept across epochs with the next epoch prefetched, H2D copies on a side stream.

    python examples/data_pipeline.py            # GPU if there is one, else CPU
    python examples/data_pipeline.py --device cpu --epochs 3

Task: sequences of 4..64 tokens from a vocabulary of 32; the label says whether token 0 occurs
more often than token 1. A bag-of-embeddings model with a length mask learns it in a few epochs.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from aiak.data import BalancedDistributedSampler, CrossEpochLoader, CudaPrefetcher, pad_collate


class Sequences(Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(4, 65, (n,), generator=g).tolist()
        self.tokens = [torch.randint(0, 32, (k,), generator=g) for k in self.lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokens[i]
        return t, torch.tensor(int((t == 0).sum() > (t == 1).sum()))


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)
        self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
        summed = (self.embed(tokens) * mask[..., None]).sum(1)  # counts, not means
        return self.head(summed / 8)


def train(
    device: str, epochs: int = 4, samples: int = 2048, workers: int = 2, plain: bool = False
) -> float:
    """Train on one rank of a (simulated) 1-rank job; returns the last epoch's mean loss.

    ``plain=True`` iterates the bare ``DataLoader`` (``set_epoch`` each epoch) instead: the
    batches, their order and so the losses are the same.
    """
    torch.manual_seed(0)
    data = Sequences(samples)
    sampler = BalancedDistributedSampler(data.lengths, num_replicas=1, rank=0, max_tokens=2048)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=pad_collate, num_workers=workers)
    model = BagModel().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with contextlib.ExitStack() as stack:
        if plain:
            batches: Any = loader
        else:
            reuse = stack.enter_context(CrossEpochLoader(loader))
            batches = CudaPrefetcher(reuse, device=device)
        for epoch in range(epochs):
            if plain:
                sampler.set_epoch(epoch)
            total, count = 0.0, 0
            for tokens, labels, lengths in batches:
                tokens, labels, lengths = (t.to(device) for t in (tokens, labels, lengths))
                loss = nn.functional.cross_entropy(model(tokens, lengths), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, count = total + loss.item(), count + 1
    return total / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--epochs", type=int, default=6)
    args = p.parse_args()
    print(f"last epoch mean loss: {train(args.device, args.epochs):.4f} (chance: 0.693)")


if __name__ == "__main__":
    main()
