"""Offloading hooks to the worker thread."""

from __future__ import annotations

import pytest
import torch

from aiak import comm


class _Bucket:
    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def buffer(self) -> torch.Tensor:
        return self._t


def test_offload_runs_in_order_and_forwards_results() -> None:
    from aiak.comm import _offload

    ran: list[int] = []

    def run(bucket: _Bucket) -> torch.futures.Future:
        ran.append(int(bucket.buffer()[0]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    futs = [_offload.submit(run, _Bucket(torch.tensor([float(i)]))) for i in range(50)]
    values = [f.wait() for f in futs]
    assert ran == list(range(50))  # FIFO: collectives keep DDP's order on every rank
    assert [int(v[0]) for v in values] == [2 * i for i in range(50)]


def test_offload_errors_reach_the_waiter_and_the_worker_survives() -> None:
    from aiak.comm import _offload

    def raises(bucket: _Bucket) -> torch.futures.Future:
        raise FloatingPointError("rank 0: bad gradients")

    def fails_later(bucket: _Bucket) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_exception(ValueError("peer died"))
        return fut

    def fine(bucket: _Bucket) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    t = torch.ones(3)
    bad, later, good = (_offload.submit(f, _Bucket(t)) for f in (raises, fails_later, fine))
    with pytest.raises(Exception, match=r"FloatingPointError.*rank 0: bad gradients"):
        bad.wait()
    with pytest.raises(Exception, match="peer died"):
        later.wait()
    assert torch.equal(good.wait(), t)


def test_register_rejects_a_non_bool_offload() -> None:
    ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)
    ddp.bucket_bytes_cap = 25 * 2**20
    with pytest.raises(TypeError, match="offload"):
        comm.register(ddp, comm.allreduce(), offload="yes")


@pytest.mark.parametrize(
    ("make", "syncs"),
    [
        (lambda: comm.allreduce(), False),
        (lambda: comm.fp16_compress(scale=10), False),
        (lambda: comm.powersgd(rank=2, start_iter=2), False),
        (lambda: comm.hierarchical(outer=comm.fp16_compress()), False),
        (lambda: comm.nan_check(), True),
        (lambda: comm.fp16_compress(comm.nan_check()), True),
        (lambda: comm.multi_stream(comm.nan_check(), streams=2), True),
        (lambda: comm.hierarchical(outer=comm.nan_check(comm.powersgd(start_iter=2))), True),
    ],
)
def test_trees_that_wait_on_the_host_are_the_ones_offloaded_by_default(make, syncs) -> None:
    # offload=None runs a tree on the worker thread (for CUDA buckets) exactly when some hook
    # in it waits for the GPU on the host; the rest are cheaper inline (2 x H200 measurements).
    assert make().syncing() is syncs
