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

from aiak.ops._args import check_bool, check_float, check_int, check_sequence

__all__ = ["BalancedDistributedSampler", "PadCollate", "pad_collate"]

_OP = "BalancedDistributedSampler"
_INT64 = 2**63
_MAX_REPLICAS = 2**20


def _lengths(value: Any) -> torch.Tensor:
    """``lengths`` as a 1-D int64 tensor, or an error naming it and the first bad entry."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        items = check_sequence("lengths", value, op=_OP)
        try:
            t = torch.as_tensor(items)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            for i, v in enumerate(items):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(
                        f"{_OP}: lengths[{i}] must be an int, got {v!r} ({type(v).__name__})"
                    ) from None
                if not -(2**63) <= v < 2**63:
                    raise ValueError(f"{_OP}: lengths[{i}]={v} is beyond int64") from None
            raise TypeError(f"{_OP}: lengths must be a flat sequence of ints") from None
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{_OP}: lengths must be a non-empty 1-D sequence, got {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{_OP}: lengths must be integers, got {t.dtype}")
    t = t.to("cpu", torch.int64)
    if int(t.min()) < 0:
        i = int(t.argmin())
        raise ValueError(f"{_OP}: lengths must be >= 0, got lengths[{i}]={int(t[i])}")
    return t


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
        lengths = _lengths(lengths)
        # every step holds a batch per rank: the plan is O(num_replicas) per step
        check_int("num_replicas", num_replicas, ge=1, le=_MAX_REPLICAS, op=_OP)
        check_int("rank", rank, ge=0, op=_OP)
        if rank >= num_replicas:
            raise ValueError(f"{_OP}: rank must be < num_replicas ({num_replicas}), got {rank}")
        if (batch_size is None) == (max_tokens is None):
            raise ValueError(f"{_OP}: give exactly one of batch_size and max_tokens")
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, ge=1, op=_OP)
        if max_tokens is not None:
            max_tokens = check_int("max_tokens", max_tokens, ge=1, lt=_INT64, op=_OP)
            longest = int(lengths.max())
            if longest > max_tokens:
                i = int(lengths.argmax())
                raise ValueError(f"{_OP}: max_tokens={max_tokens} < lengths[{i}]={longest}")
        # the generator's seed is seed + epoch; torch takes seeds in [-2^63, 2^64)
        seed = check_int("seed", seed, ge=-_INT64, lt=_INT64, op=_OP)
        group_steps = check_int("group_steps", group_steps, ge=1, op=_OP)
        self.lengths = lengths
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.shuffle = check_bool("shuffle", shuffle, op=_OP)
        self.seed = seed
        self.drop_last = check_bool("drop_last", drop_last, op=_OP)
        self.group_steps = group_steps
        self.epoch = 0
        self._cache: tuple[int, list[list[list[int]]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next plan (an int >= 0; ``seed + epoch`` seeds its permutations)."""
        self.epoch = check_int("epoch", epoch, ge=0, lt=_INT64, op=f"{_OP}.set_epoch")

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
        op = "PadCollate"
        # a padded length is rounded up to it: beyond 2^16 the padding is the batch
        self.pad_to_multiple_of = check_int(
            "pad_to_multiple_of", pad_to_multiple_of, ge=1, le=2**16, op=op
        )
        if isinstance(padding_value, dict):
            for k, v in padding_value.items():
                check_float(f"padding_value[{k!r}]", v, finite=False, allow_nan=True, op=op)
        else:
            check_float("padding_value", padding_value, finite=False, allow_nan=True, op=op)
        self.padding_value = padding_value

    def _value(self, key: Any, dtype: torch.dtype) -> float:
        """The padding value of field ``key``, checked against the field's dtype: a value the
        dtype cannot hold would be silently rounded or wrapped by ``new_full``."""
        if isinstance(self.padding_value, dict):
            value, name = self.padding_value.get(key, 0), f"padding_value[{key!r}]"
        else:
            value, name = self.padding_value, "padding_value"
        if dtype == torch.bool:
            ok = value in (0, 1)
        elif dtype.is_floating_point or dtype.is_complex:
            value = float(value)  # checked convertible when built
            real = torch.finfo(dtype).max
            ok = not math.isfinite(value) or abs(value) <= real
        else:
            info = torch.iinfo(dtype)
            ok = math.isfinite(value) and value == int(value) and info.min <= value <= info.max
        if not ok:
            raise ValueError(
                f"pad_collate: {name}={value!r} cannot be stored in field {key!r} of dtype {dtype}"
            )
        return value

    def _field(self, items: list[Any], key: Any) -> tuple[Any, torch.Tensor | None]:
        first = items[0]
        if isinstance(first, torch.Tensor):
            for i, t in enumerate(items):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(
                        f"pad_collate: field {key!r} of sample {i} is a {type(t).__name__}, but "
                        "of sample 0 a tensor"
                    )
                if t.dim() != first.dim():
                    raise ValueError(
                        f"pad_collate: field {key!r} of sample {i} has {t.dim()} dims (shape "
                        f"{tuple(t.shape)}), of sample 0 {first.dim()} ({tuple(first.shape)})"
                    )
                if t.dtype != first.dtype:
                    raise TypeError(
                        f"pad_collate: field {key!r} of sample {i} has dtype {t.dtype}, of "
                        f"sample 0 {first.dtype}; cast the samples to one dtype"
                    )
                if t.device != first.device:
                    raise ValueError(
                        f"pad_collate: field {key!r} of sample {i} is on {t.device}, of sample "
                        f"0 on {first.device}"
                    )
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            for i, t in enumerate(items):
                if t.shape[1:] != first.shape[1:]:
                    raise ValueError(
                        f"pad_collate: field {key!r} of sample {i} must be a tensor of shape "
                        f"[L, *{tuple(first.shape[1:])}], got {tuple(t.shape)}"
                    )
            lengths = torch.tensor([t.shape[0] for t in items], dtype=torch.int64)
            longest = int(lengths.max()) if items else 0
            m = self.pad_to_multiple_of
            longest = math.ceil(longest / m) * m
            value = self._value(key, first.dtype)
            out = first.new_full((len(items), longest, *first.shape[1:]), value)
            for i, t in enumerate(items):
                out[i, : t.shape[0]] = t
            return out, lengths
        if isinstance(first, torch.Tensor):
            return torch.stack(items), None
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            for i, v in enumerate(items):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(
                        f"pad_collate: field {key!r} of sample {i} is {v!r}, of sample 0 a number"
                    )
            try:
                return torch.tensor(items), None
            except (RuntimeError, OverflowError, TypeError, ValueError):
                raise ValueError(
                    f"pad_collate: field {key!r} holds a number beyond int64: {items}"
                ) from None
        return list(items), None

    def __call__(self, samples: Sequence[Any]) -> Any:
        if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
            raise TypeError(
                f"pad_collate: samples must be a list of samples, got {type(samples).__name__}"
            )
        if len(samples) == 0:
            raise ValueError("pad_collate: empty batch")
        first = samples[0]
        if isinstance(first, torch.Tensor):
            out, lengths = self._field(list(samples), 0)
            if lengths is None:
                raise ValueError("pad_collate: samples must have a length dimension (dim >= 1)")
            return out, lengths
        if isinstance(first, dict):
            for i, s in enumerate(samples):
                if not isinstance(s, dict):
                    raise TypeError(
                        f"pad_collate: sample {i} is a {type(s).__name__}, sample 0 a dict"
                    )
                if s.keys() != first.keys():
                    missing = [k for k in first if k not in s]
                    extra = [k for k in s if k not in first]
                    raise ValueError(
                        f"pad_collate: sample {i} has keys {list(s)}, sample 0 {list(first)} "
                        f"(missing {missing}, extra {extra})"
                    )
            if "lengths" in first:
                raise ValueError("pad_collate: a sample's key 'lengths' would be overwritten")
            result: dict[Any, Any] = {}
            lengths = None
            for k in first:
                result[k], lens = self._field([s[k] for s in samples], k)
                lengths = lengths if lengths is not None else lens
            if lengths is not None:
                result["lengths"] = lengths
            return result
        if isinstance(first, (tuple, list)):
            for i, s in enumerate(samples):
                if not isinstance(s, (tuple, list)):
                    raise TypeError(
                        f"pad_collate: sample {i} is a {type(s).__name__}, sample 0 a "
                        f"{type(first).__name__}"
                    )
                if len(s) != len(first):
                    raise ValueError(
                        f"pad_collate: sample {i} has {len(s)} fields, sample 0 has {len(first)}"
                    )
            fields, lengths = [], None
            for j in range(len(first)):
                out, lens = self._field([s[j] for s in samples], j)
                fields.append(out)
                lengths = lengths if lengths is not None else lens
            return (*fields, lengths) if lengths is not None else tuple(fields)
        raise TypeError(f"pad_collate: samples must be tensors, tuples or dicts, got {type(first)}")


pad_collate = PadCollate()
