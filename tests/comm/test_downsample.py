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
    sgd_momentum=st.sampled_from([0.0, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_each_element_sends_its_memory_at_its_turn(
    sizes, n, rotation, momentum, sgd_momentum, seed
):
    bucket = LayoutBucket(sizes)
    length = bucket.buf.numel()
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.rand(length, generator=gen) + 0.5 for _ in range(3 * n)]
    hook = comm.downsample(n=n, momentum=momentum, rotation=rotation, sgd_momentum=sgd_momentum)
    outs = run(hook, bucket, grads)
    mem = torch.zeros(length, dtype=torch.float64)
    vel = torch.zeros(length, dtype=torch.float64)  # every element's, travelling or not
    for step, (g, out) in enumerate(zip(grads, outs)):
        vel = sgd_momentum * vel + g.double()
        mem = momentum * mem + (vel if sgd_momentum else g.double())
        mask = travels(rotation, length, n, step)
        expect = torch.where(mask, mem, torch.zeros_like(mem))
        torch.testing.assert_close(out.double(), expect, rtol=1e-6, atol=1e-6)
        mem[mask] = 0
    # every element travels exactly once in any n consecutive steps
    sent = torch.stack([o != 0 for o in outs[n : 2 * n]])
    assert bool((sent.sum(0) == 1).all())


def test_strided_reaches_every_tensor_every_step():
    # "strided": no tensor waits n steps for its whole update at once.
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


def test_settings_are_validated_and_pickled():
    with pytest.raises(ValueError, match="rotation"):
        comm.downsample(n=2, rotation="random")
    with pytest.raises(ValueError, match="sgd_momentum"):
        comm.downsample(n=2, sgd_momentum=1.0)
    with pytest.raises(TypeError, match="sgd_momentum"):
        comm.downsample(n=2, sgd_momentum="0.9")
    state = comm.downsample(n=3, rotation="strided").state
    assert pickle.loads(pickle.dumps(state)).rotation == "strided"
    state = comm.downsample(n=3).state
    assert state.rotation == "contiguous" and state.sgd_momentum == 0.0
    # a state pickled before ``rotation`` existed rotated blocks: it continues doing so
    d = state.__getstate__()
    del d["rotation"]
    old = comm.DownsampleState.__new__(comm.DownsampleState)
    old.__setstate__(d)
    assert old.rotation == "contiguous" and old.n == 3
    assert old.sgd_momentum == 0.0 and old.velocity == {}


def test_sgd_momentum_velocity_survives_pickling():
    sizes, n = [10, 6], 3
    gen = torch.Generator().manual_seed(0)
    grads = [torch.rand(sum(sizes), generator=gen) for _ in range(8)]
    hook = comm.downsample(n=n, sgd_momentum=0.9)
    whole = run(hook, LayoutBucket(sizes), grads)
    first = comm.downsample(n=n, sgd_momentum=0.9)
    run(first, LayoutBucket(sizes), grads[:4])
    resumed = comm.downsample(n=n, sgd_momentum=0.9)
    resumed.state.__setstate__(pickle.loads(pickle.dumps(first.state)).__getstate__())
    assert resumed.state.velocity and resumed.state.memory
    state = ready(resumed, CountingGroup())
    bucket = LayoutBucket(sizes)
    for step in range(4, 8):
        bucket.buf.copy_(grads[step])
        sub = _buckets.SubBucket(bucket.buffer(), None, bucket, step=step)
        out = _futures.real(resumed.reduce(state, sub, state._link)).wait()
        assert torch.equal(out, whole[step])
