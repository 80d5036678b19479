"""aiak.data.CrossEpochLoader: same order as the plain DataLoader, workers reused, the next
epoch prefetched across the boundary, errors delivered, every worker stopped."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from aiak.data import BalancedDistributedSampler, CrossEpochLoader, CudaPrefetcher, pad_collate


class Numbers(Dataset):
    def __init__(self, n: int, counter=None, fail_at: int | None = None) -> None:
        self.n, self.counter, self.fail_at = n, counter, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is missing")
        if self.counter is not None:
            with self.counter.get_lock():
                self.counter.value += 1
        return {"x": torch.full((1 + i % 3,), float(i)), "i": i}


def _ids(batch) -> list[int]:
    return [int(i) for i in batch["i"]]


def _collate(samples):
    return {"x": [s["x"] for s in samples], "i": torch.tensor([s["i"] for s in samples])}


def _reference(make_sampler, epochs: int, **kw) -> list[list[list[int]]]:
    sampler = make_sampler()
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        out.append([_ids(b) for b in DataLoader(Numbers(23), sampler=sampler, **kw)])
    return out


def test_order_equals_the_plain_loader_with_a_per_epoch_sampler() -> None:
    def make():
        return DistributedSampler(Numbers(23), num_replicas=2, rank=1, shuffle=True, seed=5)

    ref = _reference(make, 4, batch_size=3, collate_fn=_collate)
    loader = DataLoader(
        Numbers(23), sampler=make(), batch_size=3, collate_fn=_collate, num_workers=2
    )
    with CrossEpochLoader(loader) as ours:
        assert len(ours) == len(ref[0])
        got = [[_ids(b) for b in ours] for _ in range(4)]
    assert got == ref
    assert ref[0] != ref[1]  # the epochs really differ


def test_order_equals_the_plain_loader_with_the_balanced_sampler() -> None:
    lengths = [1 + i % 3 for i in range(23)]
    ds = Numbers(23)

    def make():
        return BalancedDistributedSampler(lengths, 2, 0, max_tokens=6, seed=1, group_steps=2)

    ref = []
    s = make()
    for e in range(3):
        s.set_epoch(e)
        ref.append([_ids(b) for b in DataLoader(ds, batch_sampler=s, collate_fn=_collate)])
    loader = DataLoader(ds, batch_sampler=make(), collate_fn=_collate, num_workers=2)
    with CrossEpochLoader(loader, prefetch=3) as ours:
        assert [[_ids(b) for b in ours] for _ in range(3)] == ref


def test_default_collate_and_unbatched_loaders() -> None:
    ds = Numbers(5)
    with CrossEpochLoader(DataLoader(ds, batch_size=None, num_workers=1)) as ours:
        got = [b["i"] for b in ours]
    assert got == [0, 1, 2, 3, 4]


def test_the_next_epoch_is_produced_before_it_is_asked_for() -> None:
    counter = mp.get_context("fork").Value("i", 0)
    ds = Numbers(12, counter=counter)
    loader = DataLoader(ds, batch_size=4, collate_fn=_collate, num_workers=2)
    with CrossEpochLoader(loader, prefetch=2) as ours:
        assert sum(len(_ids(b)) for b in ours) == 12  # epoch 0 consumed, epoch 1 not started
        deadline = time.monotonic() + 30
        while counter.value < 12 + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Two batches (the prefetch window) of epoch 1 were loaded with no iter() call.
        assert counter.value == 12 + 8
        assert [len(_ids(b)) for b in ours] == [4, 4, 4]


def test_workers_live_across_epochs_and_stop_on_close() -> None:
    loader = DataLoader(Numbers(10), batch_size=4, collate_fn=_collate, num_workers=2)
    ours = CrossEpochLoader(loader)
    pids = [w.pid for w in ours.workers]
    for _ in range(3):
        list(ours)
        assert [w.pid for w in ours.workers] == pids and all(w.is_alive() for w in ours.workers)
    workers = ours.workers
    ours.close()
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        iter(ours)


def test_workers_stop_when_the_loader_is_collected() -> None:
    loader = DataLoader(Numbers(10), batch_size=4, collate_fn=_collate, num_workers=2)
    ours = CrossEpochLoader(loader)
    it = iter(ours)
    next(it)
    workers = ours.workers
    del ours, it
    gc.collect()
    assert not any(w.is_alive() for w in workers)


def test_worker_exception_reaches_the_loop_with_its_traceback() -> None:
    loader = DataLoader(Numbers(10, fail_at=5), batch_size=2, collate_fn=_collate, num_workers=2)
    with CrossEpochLoader(loader) as ours:
        seen = []
        with pytest.raises(KeyError) as info:
            for b in ours:
                seen.extend(_ids(b))
        assert seen == [0, 1, 2, 3]
        text = str(info.value)
        assert "CrossEpochLoader worker" in text and "__getitem__" in text
        assert "sample 5 is missing" in text
        # The failure belongs to its batch: the next epoch runs up to it again.
        assert _ids(next(iter(ours))) == [0, 1]


def test_a_killed_worker_is_an_error_not_a_hang() -> None:
    loader = DataLoader(Numbers(40), batch_size=2, collate_fn=_collate, num_workers=1)
    with CrossEpochLoader(loader, prefetch=1) as ours:
        it = iter(ours)
        next(it)
        os.kill(ours.workers[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            list(it)


class Slow(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        time.sleep(30)
        return i


def test_timeout_bounds_the_wait_for_a_batch() -> None:
    loader = DataLoader(Slow(), batch_size=2, num_workers=1)
    with CrossEpochLoader(loader, timeout=1) as ours:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            next(iter(ours))
        assert time.monotonic() - start < 20
        workers = ours.workers
    assert not any(w.is_alive() for w in workers)  # a busy worker is terminated on close


def test_set_epoch_and_abandoned_epochs() -> None:
    def make():
        return DistributedSampler(Numbers(23), num_replicas=1, rank=0, shuffle=True, seed=2)

    ref = _reference(make, 6, batch_size=5, collate_fn=_collate)
    loader = DataLoader(
        Numbers(23), sampler=make(), batch_size=5, collate_fn=_collate, num_workers=2
    )
    with CrossEpochLoader(loader) as ours:
        it = iter(ours)
        assert _ids(next(it)) == ref[0][0]  # epoch 0 abandoned after one batch
        assert [_ids(b) for b in ours] == ref[1]
        ours.set_epoch(4)  # the prefetched epoch 2 is dropped
        assert [_ids(b) for b in ours] == ref[4]
        assert [_ids(b) for b in ours] == ref[5]
        ours.set_epoch(3)
        assert [_ids(b) for b in ours] == ref[3]


def test_composes_with_the_prefetcher_and_pad_collate() -> None:
    lengths = [1 + i % 3 for i in range(9)]

    class Seqs(Dataset):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((lengths[i],), i)

    sampler = BalancedDistributedSampler(lengths, 1, 0, batch_size=4, shuffle=False)
    loader = DataLoader(Seqs(), batch_sampler=sampler, collate_fn=pad_collate, num_workers=1)
    with CrossEpochLoader(loader) as ours:
        batches = list(CudaPrefetcher(ours, device="cpu"))
    seen = sorted(int(x[0]) for padded, _ in batches for x in padded)
    assert seen == list(range(9))
    for padded, lens in batches:
        assert padded.shape[1] == int(lens.max())


def test_bad_loaders_are_rejected() -> None:
    with pytest.raises(TypeError, match="DataLoader"):
        CrossEpochLoader([1, 2])
    with pytest.raises(ValueError, match="num_workers"):
        CrossEpochLoader(DataLoader(Numbers(3)))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="map-style"):
        CrossEpochLoader(DataLoader(Stream(), num_workers=1))
    with pytest.raises(ValueError, match="prefetch"):
        CrossEpochLoader(DataLoader(Numbers(3), num_workers=1), prefetch=0)
