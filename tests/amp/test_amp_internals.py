"""amp's multi-tensor copies (both backends), its transition table, and lean import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiak.amp import TRANSITIONS, AmpStateError, Event, Stage, _multi_tensor
from aiak.amp._state import next_stage

HAS_OP = _multi_tensor.default_backend() == "aiak"
BACKENDS = [
    "foreach",
    pytest.param("aiak", marks=pytest.mark.skipif(not HAS_OP, reason="aiak.ops op absent")),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
shapes = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 37)), min_size=0, max_size=6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    shapes=shapes,
    src_dtype=st.sampled_from(DTYPES),
    dst_dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1.0, 2.0**-16, 0.5, 3.0]),
    bad=st.sampled_from([None, float("inf"), float("-inf"), float("nan")]),
    seed=st.integers(0, 2**16),
)
def test_scale_matches_torch_and_flags_non_finite(
    backend: str,
    shapes: list,
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype,
    scale: float,
    bad: float | None,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(s, generator=g).mul_(100).to(src_dtype) for s in shapes]
    if bad is not None and any(t.numel() for t in src):
        next(t for t in src if t.numel()).view(-1)[-1] = bad
    dst = [torch.full(t.shape, 7.0, dtype=dst_dtype) for t in src]
    found = torch.zeros((), dtype=torch.float32)
    _multi_tensor.scale_(src, dst, torch.tensor(scale), found, backend)
    for s, d in zip(src, dst):
        # fp32 product, rounded once to the destination dtype: exact for both backends.
        expected = (s.float() * scale).to(dst_dtype)
        assert torch.equal(d.isnan(), expected.isnan())
        assert torch.equal(d[~d.isnan()], expected[~expected.isnan()])
    has_bad = bad is not None and any(t.numel() for t in src)
    assert found.item() == float(has_bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_is_never_cleared_and_in_place_works(backend: str) -> None:
    t = [torch.ones(3), torch.full((2, 2), 4.0)]
    found = torch.ones(())
    _multi_tensor.scale_(t, t, torch.tensor(0.5), found, backend)  # src is dst
    assert found.item() == 1.0
    assert torch.equal(t[1], torch.full((2, 2), 2.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_keeps_channels_last(backend: str) -> None:
    src = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    dst = [torch.empty_like(src[0], dtype=torch.float16)]
    _multi_tensor.copy_(src, dst, backend)
    assert dst[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(dst[0], src[0].half())


def test_bad_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        _multi_tensor.scale_([], [], torch.ones(()), torch.zeros(()), "cuda")


# -- the state machine ----------------------------------------------------------------------------


def test_every_stage_is_reachable_and_zero_grad_always_resets() -> None:
    reached, frontier = {Stage.IDLE}, [Stage.IDLE]
    while frontier:
        stage = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is stage and dst not in reached:
                reached.add(dst)
                frontier.append(dst)
    assert reached == set(Stage)
    assert all(next_stage(s, Event.ZERO_GRAD) is Stage.IDLE for s in Stage)


@given(st.lists(st.sampled_from(list(Event)), max_size=30))
def test_random_event_sequences_follow_the_table(events: list[Event]) -> None:
    stage = Stage.IDLE
    for event in events:
        if (stage, event) in TRANSITIONS:
            stage = next_stage(stage, event)
        else:
            with pytest.raises(AmpStateError, match=event.value):
                next_stage(stage, event)


def test_copy_back_only_after_a_step() -> None:
    for stage in Stage:
        if stage is not Stage.STEPPED:
            with pytest.raises(AmpStateError):
                next_stage(stage, Event.COPIED_BACK)


def test_import_is_lean() -> None:
    """Importing aiak.amp initialises no CUDA and imports neither cupy nor numba."""
    code = (
        "import sys, torch, aiak.amp; "
        "assert not torch.cuda.is_initialized(); "
        "bad = [m for m in ('cupy', 'numba') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
