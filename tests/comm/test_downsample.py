"""aiak.comm.downsample on one process: which elements travel each step, and what they carry.

A 2-rank fake group whose peer holds the same values makes the average equal to this rank's
own memory, so every output is checked against a plain loop over elements.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak import comm
from aiak.comm import _buckets, _futures

sys.path.insert(0, str(Path(__file__).parent))
from _fake import CountingGroup, ready


class LayoutBucket:
    """One DDP-like bucket: a flat buffer and per-tensor views into it, back to back."""

    def __init__(self, sizes: list[int]) -> None:
        self.buf = torch.zeros(sum(sizes))
        self.views, self.params, at = [], [], 0
        for n in sizes:
            self.views.append(self.buf[at : at + n])
            self.params.append(torch.nn.Parameter(torch.zeros(n)))
            at += n

    def buffer(self) -> torch.Tensor:
        return self.buf

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def travels(length: int, n: int, step: int) -> torch.Tensor:
    """The elements that travel at ``step``: block ``step % n`` of ``n`` (a bool mask)."""
    q = torch.arange(length)
    c = step % n
    return (q >= c * length // n) & (q < (c + 1) * length // n)


def run(hook, bucket: LayoutBucket, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    state = ready(hook, CountingGroup())
    outs = []
    for step, g in enumerate(grads):
        bucket.buf.copy_(g)
        sub = _buckets.SubBucket(bucket.buffer(), None, bucket, step=step)
        outs.append(_futures.real(hook.reduce(state, sub, state._link)).wait().clone())
    return outs


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 13), min_size=1, max_size=4),
    n=st.integers(2, 5),
    momentum=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_each_element_sends_its_memory_at_its_turn(sizes, n, momentum, seed):
    bucket = LayoutBucket(sizes)
    length = bucket.buf.numel()
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.rand(length, generator=gen) + 0.5 for _ in range(3 * n)]
    outs = run(comm.downsample(n=n, momentum=momentum), bucket, grads)
    mem = torch.zeros(length, dtype=torch.float64)
    for step, (g, out) in enumerate(zip(grads, outs)):
        mem = momentum * mem + g.double()
        mask = travels(length, n, step)
        expect = torch.where(mask, mem, torch.zeros_like(mem))
        torch.testing.assert_close(out.double(), expect, rtol=1e-6, atol=1e-6)
        mem[mask] = 0
    # every element travels exactly once in any n consecutive steps
    sent = torch.stack([o != 0 for o in outs[n : 2 * n]])
    assert bool((sent.sum(0) == 1).all())


def test_memory_survives_pickling_bit_for_bit():
    sizes, n = [10, 6], 3
    gen = torch.Generator().manual_seed(0)
    grads = [torch.rand(sum(sizes), generator=gen) for _ in range(8)]
    whole = run(comm.downsample(n=n, momentum=0.9), LayoutBucket(sizes), grads)
    first = comm.downsample(n=n, momentum=0.9)
    run(first, LayoutBucket(sizes), grads[:4])
    resumed = comm.downsample(n=n, momentum=0.9)
    resumed.state.__setstate__(pickle.loads(pickle.dumps(first.state)).__getstate__())
    assert resumed.state.memory
    state = ready(resumed, CountingGroup())
    bucket = LayoutBucket(sizes)
    for step in range(4, 8):
        bucket.buf.copy_(grads[step])
        sub = _buckets.SubBucket(bucket.buffer(), None, bucket, step=step)
        out = _futures.real(resumed.reduce(state, sub, state._link)).wait()
        assert torch.equal(out, whole[step])
