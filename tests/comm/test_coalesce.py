"""Coalescing buckets (``coalesce=k``): which buckets share a collective call, errors, options.

Single process: a fake 2-rank process group records each call's kind and size.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from aiak import comm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fake import CountingGroup as _CountingGroup
from _fake import IndexedBucket as _IndexedBucket
from _fake import ready as _ready


@pytest.mark.parametrize("make", [comm.allreduce, lambda: comm.fp16_compress(scale=4)])
@pytest.mark.parametrize(("n", "k"), [(7, 3), (4, 2), (3, 5), (5, 1)])
def test_coalesce_groups_buckets_at_fixed_indices(make, n, k) -> None:
    group = _CountingGroup()
    hook = make()
    state = _ready(hook, group, k)
    buckets = [_IndexedBucket(i, n, 37 + i) for i in range(n)]
    expect = [b.buf.clone() for b in buckets]
    futs = []
    for b in buckets:
        futs.append(hook.run(state, b))
    sizes = [min(k, n - s) for s in range(0, n, k)]
    kinds = ["coalesced" if s > 1 else "allreduce" for s in sizes]
    assert group.calls == list(zip(kinds, sizes, strict=True))
    for f, b, e in zip(futs, buckets, expect, strict=True):
        out = f.wait()
        assert out.data_ptr() == b.buf.data_ptr()  # averaged in place, as DDP expects
        torch.testing.assert_close(out, e, rtol=1e-3, atol=0)


def test_coalesce_holds_until_the_group_is_full() -> None:
    group = _CountingGroup()
    hook = comm.allreduce()
    state = _ready(hook, group, 3)
    futs = [hook.run(state, _IndexedBucket(i, 6, 8)) for i in range(2)]
    assert group.calls == [] and not any(f.done() for f in futs)
    futs.append(hook.run(state, _IndexedBucket(2, 6, 8)))
    assert group.calls == [("coalesced", 3)] and all(f.done() for f in futs)


def test_coalesce_drops_a_failed_steps_held_buckets() -> None:
    # A step that raised before its last bucket leaves buckets held; the next step must not
    # send them (other ranks never held them): they fail, and the new step starts clean.
    group = _CountingGroup()
    hook = comm.allreduce()
    state = _ready(hook, group, 4)
    stale = hook.run(state, _IndexedBucket(0, 6, 8))
    fresh = [hook.run(state, _IndexedBucket(i, 2, 8)) for i in range(2)]
    assert group.calls == [("coalesced", 2)]
    with pytest.raises(Exception, match="never issued"):
        stale.wait()
    assert all(torch.isfinite(f.wait()).all() for f in fresh)


def test_coalesced_failure_names_the_call_and_reaches_every_bucket() -> None:
    group = _CountingGroup(fail=True)
    hook = comm.fp16_compress()
    state = _ready(hook, group, 2)
    futs = [hook.run(state, _IndexedBucket(i, 2, 8)) for i in range(2)]
    for f in futs:
        with pytest.raises(Exception, match=r"coalesced allreduce of 2 buckets.*peer 1 is gone"):
            f.wait()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_coalesce_must_be_a_positive_int(value) -> None:
    ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)
    ddp.bucket_bytes_cap = 25 * 2**20
    with pytest.raises(ValueError, match="coalesce"):
        comm.register(ddp, comm.allreduce(), coalesce=value)


def test_coalesce_from_env_and_through_pickling() -> None:
    hook = comm.from_env({"AIAK_COALESCE_BUCKETS": "3"})
    assert type(hook).__name__ == "Allreduce" and hook.state.coalesce == 3
    assert comm.from_env({"AIAK_FP16_COMPRESSION": "1"}).state.coalesce == 1
    with pytest.raises(ValueError, match="AIAK_COALESCE_BUCKETS"):
        comm.parse_env({"AIAK_COALESCE_BUCKETS": "0"})
    state = pickle.loads(pickle.dumps(hook.state))
    assert state.coalesce == 3
