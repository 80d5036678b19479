"""aiak.data.BalancedDistributedSampler and pad_collate: coverage, the balance bound,
determinism (hypothesis over length distributions and replica counts)."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from aiak.data import BalancedDistributedSampler, PadCollate, pad_collate

LENGTHS = st.one_of(
    st.lists(st.integers(1, 512), min_size=1, max_size=300),  # uniform
    st.lists(st.sampled_from([1, 2, 500]), min_size=1, max_size=300),  # bimodal, many ties
    st.lists(st.integers(0, 3), min_size=1, max_size=40),  # tiny, zero lengths, fewer than ranks
    st.integers(1, 200).map(lambda n: [int(1.07**i) % 700 + 1 for i in range(n)]),  # long tail
)


@st.composite
def configs(draw):
    lengths = draw(LENGTHS)
    replicas = draw(st.integers(1, 8))
    kw = {
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "drop_last": draw(st.booleans()),
    }
    kw["group_steps"] = draw(st.sampled_from([1, 3, 64]))
    if draw(st.booleans()):
        kw["batch_size"] = draw(st.integers(1, 16))
    else:
        kw["max_tokens"] = max(1, *lengths) + draw(st.integers(0, 2000))
    return lengths, replicas, kw, draw(st.integers(0, 5))


def _plans(lengths, replicas, kw, epoch):
    samplers = [BalancedDistributedSampler(lengths, replicas, r, **kw) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@given(configs())
def test_same_batch_count_on_every_rank_and_each_sample_once(cfg) -> None:
    lengths, R, kw, epoch = cfg
    samplers, per_rank = _plans(lengths, R, kw, epoch)
    n = len(lengths)
    assert len({len(b) for b in per_rank}) == 1
    assert all(len(s) == len(per_rank[0]) for s in samplers)
    assert all(batch for batches in per_rank for batch in batches)  # no empty batch
    counts = collections.Counter(i for batches in per_rank for b in batches for i in b)
    assert set(counts) <= set(range(n))
    duplicates = sum(c - 1 for c in counts.values())
    missing = n - len(counts)
    if kw["drop_last"]:
        assert duplicates == 0
        if "batch_size" in kw:
            assert missing == n % (R * kw["batch_size"])
        else:
            assert missing < R
    else:
        assert missing == 0
        assert duplicates <= R - 1
        if "batch_size" in kw:  # padding only in a leftover step with fewer samples than ranks
            tail = n % (R * kw["batch_size"])
            assert duplicates == (R - tail if 0 < tail < R else 0)


@given(configs())
def test_token_balance_bound_and_batch_limits(cfg) -> None:
    lengths, R, kw, epoch = cfg
    samplers, _ = _plans(lengths, R, kw, epoch)
    steps = samplers[0].steps()
    for step in steps:
        assert len(step) == R
        step_lens = [lengths[i] for b in step for i in b]
        tokens = [sum(lengths[i] for i in b) for b in step]
        sizes = [len(b) for b in step]
        assert max(sizes) - min(sizes) <= 1
        # The stated bound: ranks differ by at most the length spread of the step, or, in the
        # one leftover step whose batch sizes differ by one, by at most its longest sample.
        spread = max(step_lens) - min(step_lens) if len(set(sizes)) == 1 else max(step_lens)
        assert max(tokens) - min(tokens) <= spread
        if "batch_size" in kw:
            assert max(sizes) <= kw["batch_size"]
        else:
            for b in step:
                assert len(b) * max(lengths[i] for i in b) <= kw["max_tokens"]
    uneven = [s for s in steps if len({len(b) for b in s}) > 1]
    assert len(uneven) <= 1  # only the leftover step can be uneven
    if "batch_size" in kw:
        full = [s for s in steps if len(s[0]) == kw["batch_size"]]
        assert len(steps) - len(full) <= 1  # at most one short step


@given(configs())
def test_deterministic_per_seed_and_epoch(cfg) -> None:
    lengths, R, kw, epoch = cfg
    a = BalancedDistributedSampler(lengths, R, 0, **kw)
    b = BalancedDistributedSampler(lengths, R, 0, **kw)
    a.set_epoch(epoch)
    b.set_epoch(epoch + 1)
    first = list(a)
    b.set_epoch(epoch)
    assert list(b) == first
    assert list(a) == first  # iterating again gives the same plan


def test_length_grouping_beats_random_batches() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1000, (4096,), generator=g).tolist()
    s = BalancedDistributedSampler(lengths, 4, 0, batch_size=16)
    padded = sum(len(b) * max(lengths[i] for i in b) for step in s.steps() for b in step)
    real = sum(lengths)
    assert padded < 1.1 * real  # random batches of 16 would pad to ~1.9x


def test_epochs_and_seeds_change_the_order() -> None:
    lengths = list(range(1, 200))
    s = BalancedDistributedSampler(lengths, 2, 1, batch_size=4)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
    other = BalancedDistributedSampler(lengths, 2, 1, batch_size=4, seed=1)
    assert list(other) != e0
    fixed = BalancedDistributedSampler(lengths, 2, 1, batch_size=4, shuffle=False)
    fixed_e0 = list(fixed)
    fixed.set_epoch(7)
    assert list(fixed) == fixed_e0


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        BalancedDistributedSampler([1, 2], 1, 0)
    with pytest.raises(ValueError, match="exactly one"):
        BalancedDistributedSampler([1, 2], 1, 0, batch_size=1, max_tokens=4)
    with pytest.raises(ValueError, match="rank"):
        BalancedDistributedSampler([1, 2], 2, 2, batch_size=1)
    with pytest.raises(ValueError, match="num_replicas"):
        BalancedDistributedSampler([1, 2], 0, 0, batch_size=1)
    with pytest.raises(ValueError, match="lengths"):
        BalancedDistributedSampler([], 1, 0, batch_size=1)
    with pytest.raises(ValueError, match="lengths"):
        BalancedDistributedSampler([1, -1], 1, 0, batch_size=1)
    with pytest.raises(TypeError, match="lengths"):
        BalancedDistributedSampler([1.5], 1, 0, batch_size=1)
    with pytest.raises(ValueError, match=r"max_tokens=4 < lengths\[1\]=9"):
        BalancedDistributedSampler([1, 9], 1, 0, max_tokens=4)
    with pytest.raises(TypeError, match="batch_size"):
        BalancedDistributedSampler([1], 1, 0, batch_size=2.0)


def test_pad_collate_tensors() -> None:
    padded, lengths = pad_collate([torch.tensor([1, 2, 3]), torch.tensor([4])])
    assert torch.equal(padded, torch.tensor([[1, 2, 3], [4, 0, 0]]))
    assert torch.equal(lengths, torch.tensor([3, 1]))
    padded, _ = PadCollate(padding_value=-1, pad_to_multiple_of=4)([torch.ones(5, 2)])
    assert padded.shape == (1, 8, 2) and torch.all(padded[0, 5:] == -1)


def test_pad_collate_dicts_and_tuples() -> None:
    samples = [
        {"ids": torch.tensor([5, 6]), "labels": torch.tensor([1, 2]), "y": 1, "name": "a"},
        {"ids": torch.tensor([7]), "labels": torch.tensor([3]), "y": 0, "name": "b"},
    ]
    out = PadCollate(padding_value={"labels": -100})(samples)
    assert torch.equal(out["ids"], torch.tensor([[5, 6], [7, 0]]))
    assert torch.equal(out["labels"], torch.tensor([[1, 2], [3, -100]]))
    assert torch.equal(out["y"], torch.tensor([1, 0])) and out["name"] == ["a", "b"]
    assert torch.equal(out["lengths"], torch.tensor([2, 1]))
    x, y, lengths = pad_collate(
        [(torch.ones(3), torch.tensor(1)), (torch.ones(1), torch.tensor(0))]
    )
    assert x.shape == (2, 3) and torch.equal(y, torch.tensor([1, 0]))
    assert torch.equal(lengths, torch.tensor([3, 1]))


def test_pad_collate_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="shape"):
        pad_collate([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(ValueError, match="length dimension"):
        pad_collate([torch.tensor(1.0)])
    with pytest.raises(TypeError, match="samples"):
        pad_collate(["a"])
    with pytest.raises(ValueError, match="empty"):
        pad_collate([])


def test_dataloader_integration_over_two_ranks() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    data = [torch.full((n,), i) for i, n in enumerate(lengths)]
    seen = []
    for rank in range(2):
        s = BalancedDistributedSampler(lengths, 2, rank, max_tokens=10)
        for padded, lens in DataLoader(data, batch_sampler=s, collate_fn=pad_collate):
            assert padded.numel() <= 10
            seen += [int(row[0]) for row in padded]
            assert lens.tolist() == [lengths[int(row[0])] for row in padded]
    assert sorted(set(seen)) == list(range(len(lengths)))
