"""aiak.comm.downsample on one process: which elements travel each step, and what they carry.

A 2-rank fake group whose peer holds the same values makes the average equal to this rank's
own memory, so every output is checked against a plain loop over elements.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
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


def travels(rotation: str, length: int, n: int, step: int) -> torch.Tensor:
    """The elements that travel at ``step`` (a bool mask over the bucket)."""
    q = torch.arange(length)
    c = step % n
    if rotation == "strided":
        return q % n == c
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
    rotation=st.sampled_from(["strided", "contiguous"]),
    momentum=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_each_element_sends_its_memory_at_its_turn(sizes, n, rotation, momentum, seed):
    bucket = LayoutBucket(sizes)
    length = bucket.buf.numel()
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.rand(length, generator=gen) + 0.5 for _ in range(3 * n)]
    outs = run(comm.downsample(n=n, momentum=momentum, rotation=rotation), bucket, grads)
    mem = torch.zeros(length, dtype=torch.float64)
    for step, (g, out) in enumerate(zip(grads, outs)):
        mem = momentum * mem + g.double()
        mask = travels(rotation, length, n, step)
        expect = torch.where(mask, mem, torch.zeros_like(mem))
        torch.testing.assert_close(out.double(), expect, rtol=1e-6, atol=1e-6)
        mem[mask] = 0
    # every element travels exactly once in any n consecutive steps
    sent = torch.stack([o != 0 for o in outs[n : 2 * n]])
    assert bool((sent.sum(0) == 1).all())


def test_strided_reaches_every_tensor_every_step():
    # The point of "strided": no tensor waits n steps for its whole update at once.
    sizes = [40, 8, 24]
    n = 4
    bucket = LayoutBucket(sizes)
    grads = [torch.ones(sum(sizes)) for _ in range(2 * n)]
    for rotation, every_step in (("strided", True), ("contiguous", False)):
        outs = run(comm.downsample(n=n, rotation=rotation), LayoutBucket(sizes), grads)
        per_step = [[bool(v.any()) for v in out.split(sizes)] for out in outs]
        assert all(all(s) for s in per_step) is every_step
        for out in outs:
            assert int((out != 0).sum()) == pytest.approx(sum(sizes) / n, abs=1)
    assert bucket.buf.numel() == sum(sizes)


def test_rotation_is_validated_and_pickled():
    with pytest.raises(ValueError, match="rotation"):
        comm.downsample(n=2, rotation="random")
    state = comm.downsample(n=3, rotation="contiguous").state
    assert pickle.loads(pickle.dumps(state)).rotation == "contiguous"
    assert comm.downsample(n=3).state.rotation == "strided"
    # a state pickled before ``rotation`` existed rotated blocks: it continues doing so
    d = state.__getstate__()
    del d["rotation"]
    old = comm.DownsampleState.__new__(comm.DownsampleState)
    old.__setstate__(d)
    assert old.rotation == "contiguous" and old.n == 3
