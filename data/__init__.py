"""aiak.data — input pipeline helpers.

- ``CudaPrefetcher``: copies the next batches to the GPU on a side stream (optionally with a
  GPU transform there) while the current step computes; a pass-through on the CPU.
- ``CrossEpochLoader``: a ``DataLoader`` wrapper whose worker processes live across epochs and
  that prefetches epoch e+1's first batches while epoch e ends.
- ``normalize``: a prefetcher ``transform``: uint8 images -> normalised float in one pass.
- ``BalancedDistributedSampler`` + ``pad_collate``: length-grouped batches with the same count
  and near-equal tokens on every rank.

Importing this package does not initialise CUDA; it imports no other aiak subpackage.
"""

from .prefetch import CudaPrefetcher
from .reuse import CrossEpochLoader
from .sampler import BalancedDistributedSampler, PadCollate, pad_collate
from .transforms import normalize

__all__ = [
    "BalancedDistributedSampler",
    "CrossEpochLoader",
    "CudaPrefetcher",
    "PadCollate",
    "normalize",
    "pad_collate",
]
