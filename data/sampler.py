"""BalancedDistributedSampler: length-grouped batches, the same count and near-equal tokens on
every rank, plus the padding collate that goes with it.

Plan of one epoch (identical on every rank, a function of ``(seed, epoch)`` only):

1. Permute all indices (``shuffle``) with a generator seeded by ``seed + epoch``.
2. Cut the permutation into groups of ``group_steps`` steps' worth of samples and sort each
   group by length (stable, so ties keep the random order): similar lengths share a step.
3. Cut each sorted group into steps. A step is ``num_replicas`` batches, one per rank, made of
   consecutive sorted samples dealt round-robin (sample j of the step goes to rank
   ``j % num_replicas``). With ``batch_size`` a step holds ``num_replicas * batch_size``
   samples; with ``max_tokens`` it holds ``num_replicas * b`` samples, ``b`` the largest count
   with ``b * (longest length in the step) <= max_tokens``. Leftovers carry into the next group.
4. Shuffle the order of the steps; rank r takes batch r of every step.

Balance bound: within a step the ranks' real token counts (sum of lengths) differ by at most
``max_len(step) - min_len(step)`` (round-robin over sorted lengths interleaves the ranks); in
the one leftover step whose batch sizes may differ by one, by at most ``max_len(step)``. With
``max_tokens`` every rank's padded batch (size x its longest sample) is <= ``max_tokens``.

Coverage: every index appears exactly once per epoch over all ranks, except in the one leftover
step: when fewer samples than ranks remain, the ranks without one get a duplicate of a
sample of that step (at most ``num_replicas - 1`` duplicates per epoch). With
``drop_last=True`` nothing is duplicated: the incomplete leftover step is dropped instead (with
``batch_size``, that is ``len % (num_replicas * batch_size)`` random samples, removed before
grouping). The leftover step's batches may differ in size by one sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["BalancedDistributedSampler", "PadCollate", "pad_collate"]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class BalancedDistributedSampler:
    """A batch sampler (pass it as ``DataLoader(batch_sampler=...)``) for variable-length data.

    Args:
        lengths: the length (tokens) of every sample, non-negative ints.
        num_replicas, rank: the data-parallel world size and this rank.
        batch_size: samples per batch per rank; or
        max_tokens: padded tokens per batch per rank (batch size x its longest sample).
            Exactly one of the two. A sample longer than ``max_tokens`` is an error.
        shuffle: permute per epoch (otherwise the plan is a pure function of the lengths).
        seed: the shared seed; every rank must pass the same one.
        drop_last: drop the incomplete leftover step instead of duplicating samples into it.
        group_steps: steps per length-sorted group (larger: tighter length grouping, less
            randomness in which samples share a batch).

    ``set_epoch(e)`` before each epoch gives a new, reproducible plan. See the module
    docstring for the plan, the balance bound and where padding can happen.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        num_replicas: int,
        rank: int,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        group_steps: int = 64,
    ) -> None:
        lengths = torch.as_tensor(lengths)
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(
                f"lengths must be a non-empty 1-D sequence, got {tuple(lengths.shape)}"
            )
        if (
            lengths.dtype.is_floating_point
            or lengths.dtype.is_complex
            or lengths.dtype == torch.bool
        ):
            raise TypeError(f"lengths must be integers, got {lengths.dtype}")
        if int(lengths.min()) < 0:
            raise ValueError("lengths must be >= 0")
        _check_int("num_replicas", num_replicas, 1)
        _check_int("rank", rank, 0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be < num_replicas ({num_replicas}), got {rank}")
        if (batch_size is None) == (max_tokens is None):
            raise ValueError("give exactly one of batch_size and max_tokens")
        if batch_size is not None:
            _check_int("batch_size", batch_size, 1)
        if max_tokens is not None:
            _check_int("max_tokens", max_tokens, 1)
            longest = int(lengths.max())
            if longest > max_tokens:
                i = int(lengths.argmax())
                raise ValueError(f"max_tokens={max_tokens} < lengths[{i}]={longest}")
        _check_int("seed", seed, -(2**63))
        _check_int("group_steps", group_steps, 1)
        self.lengths = lengths.to(torch.int64)
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.group_steps = group_steps
        self.epoch = 0
        self._cache: tuple[int, list[list[list[int]]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def steps(self) -> list[list[list[int]]]:
        """This epoch's global plan: ``steps[s][r]`` is rank r's batch of step s."""
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self._build())
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.steps():
            yield list(step[self.rank])

    def __len__(self) -> int:
        return len(self.steps())

    # -- the plan ----------------------------------------------------------------------------

    def _build(self) -> list[list[list[int]]]:
        n, R = self.lengths.numel(), self.num_replicas
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        if self.batch_size is not None and self.drop_last:
            order = order[: n - n % (R * self.batch_size)]
        # A group covers about group_steps steps; with max_tokens a step's size is unknown
        # before sorting, so the group is sized by the average length.
        if self.batch_size is not None:
            per_group = self.group_steps * R * self.batch_size
        else:
            mean = max(1.0, float(self.lengths.float().mean()))
            per_group = self.group_steps * R * max(1, int(self.max_tokens / mean))
        steps: list[list[list[int]]] = []
        carry = torch.empty(0, dtype=torch.int64)
        for start in range(0, order.numel(), per_group):
            group = torch.cat([carry, order[start : start + per_group]])
            group = group[torch.sort(self.lengths[group], stable=True).indices]
            carry = self._cut(group, steps)
        if carry.numel():
            if carry.numel() >= R:
                steps.append(self._deal(carry.tolist()))
            elif not self.drop_last:
                ids = carry.tolist()
                steps.append(self._deal(ids + [ids[i % len(ids)] for i in range(R - len(ids))]))
        if self.shuffle:
            perm = torch.randperm(len(steps), generator=g).tolist()
            steps = [steps[i] for i in perm]
        return steps

    def _cut(self, group: torch.Tensor, steps: list[list[list[int]]]) -> torch.Tensor:
        """Append the full steps of a sorted ``group``; return the leftover (sorted) samples."""
        R, ids = self.num_replicas, group.tolist()
        lens = self.lengths[group].tolist()
        pos = 0
        while pos < len(ids):
            if self.batch_size is not None:
                size = R * self.batch_size
            else:
                # Largest b with b * (longest of the step's R*b samples) <= max_tokens; the
                # longest is the last one taken because the group is sorted.
                b = 1
                while (
                    pos + R * (b + 1) <= len(ids)
                    and (b + 1) * max(lens[pos + R * (b + 1) - 1], 1) <= self.max_tokens
                ):
                    b += 1
                size = R * b
            if pos + size > len(ids):
                break
            steps.append(self._deal(ids[pos : pos + size]))
            pos += size
        return group[pos:]

    def _deal(self, ids: list[int]) -> list[list[int]]:
        """Round-robin over sorted samples: rank r gets samples r, r+R, r+2R, ..."""
        return [ids[r :: self.num_replicas] for r in range(self.num_replicas)]


class PadCollate:
    """Collate variable-length samples by padding dim 0 to the longest in the batch.

    A batch of tensors gives ``(padded [B, L, ...], lengths [B])``. Tuples/lists of fields
    give a tuple of the collated fields followed by ``lengths``; dicts give a dict with an
    extra ``"lengths"`` key. ``lengths`` are the dim-0 sizes of the first padded field.
    Tensors with ``dim >= 1`` are padded, 0-d tensors and numbers are stacked, anything else is
    returned as a list. ``padding_value`` may be a dict per key (e.g. ``{"labels": -100}``).
    ``pad_to_multiple_of`` rounds the padded length up (tensor-core friendly shapes).
    """

    def __init__(
        self, padding_value: float | dict[Any, float] = 0, pad_to_multiple_of: int = 1
    ) -> None:
        _check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
        self.padding_value = padding_value
        self.pad_to_multiple_of = pad_to_multiple_of

    def _value(self, key: Any) -> float:
        if isinstance(self.padding_value, dict):
            return self.padding_value.get(key, 0)
        return self.padding_value

    def _field(self, items: list[Any], key: Any) -> tuple[Any, torch.Tensor | None]:
        first = items[0]
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            for i, t in enumerate(items):
                if not isinstance(t, torch.Tensor) or t.shape[1:] != first.shape[1:]:
                    raise ValueError(
                        f"pad_collate: field {key!r} of sample {i} must be a tensor of shape "
                        f"[L, *{tuple(first.shape[1:])}], got {getattr(t, 'shape', type(t))}"
                    )
            lengths = torch.tensor([t.shape[0] for t in items], dtype=torch.int64)
            longest = int(lengths.max()) if items else 0
            m = self.pad_to_multiple_of
            longest = math.ceil(longest / m) * m
            out = first.new_full((len(items), longest, *first.shape[1:]), self._value(key))
            for i, t in enumerate(items):
                out[i, : t.shape[0]] = t
            return out, lengths
        if isinstance(first, torch.Tensor):
            return torch.stack(items), None
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return torch.tensor(items), None
        return list(items), None

    def __call__(self, samples: Sequence[Any]) -> Any:
        if len(samples) == 0:
            raise ValueError("pad_collate: empty batch")
        first = samples[0]
        if isinstance(first, torch.Tensor):
            out, lengths = self._field(list(samples), 0)
            if lengths is None:
                raise ValueError("pad_collate: samples must have a length dimension (dim >= 1)")
            return out, lengths
        if isinstance(first, dict):
            result: dict[Any, Any] = {}
            lengths = None
            for k in first:
                result[k], lens = self._field([s[k] for s in samples], k)
                lengths = lengths if lengths is not None else lens
            if lengths is not None:
                result["lengths"] = lengths
            return result
        if isinstance(first, (tuple, list)):
            fields, lengths = [], None
            for j in range(len(first)):
                out, lens = self._field([s[j] for s in samples], j)
                fields.append(out)
                lengths = lengths if lengths is not None else lens
            return (*fields, lengths) if lengths is not None else tuple(fields)
        raise TypeError(f"pad_collate: samples must be tensors, tuples or dicts, got {type(first)}")


pad_collate = PadCollate()
