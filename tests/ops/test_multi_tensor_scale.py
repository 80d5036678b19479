"""aiak::multi_tensor_scale_: reference, errors, opcheck, torch.compile, CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aiak.ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


sizes_st = st.lists(st.integers(0, 70_000), min_size=1, max_size=12)


@given(
    sizes=sizes_st,
    src=st.sampled_from(DTYPES),
    dst=st.sampled_from(DTYPES),
    scale=st.floats(1e-3, 1e3),
)
def test_scale_matches_torch_bit_for_bit(
    sizes: list[int], src: torch.dtype, dst: torch.dtype, scale: float
) -> None:
    xs = [torch.randn(n).to(src) for n in sizes]
    out = [torch.full((n,), float("nan"), dtype=dst) for n in sizes]
    found = aiak.ops.multi_tensor_scale_(xs, out, scale)
    s = torch.tensor(scale, dtype=torch.float32)
    for x, o in zip(xs, out):
        assert torch.equal(o, (x.float() * s).to(dst))
    assert found.item() == 0.0


def test_scale_in_place_and_found_inf_is_sticky() -> None:
    xs = [torch.randn(100), torch.randn(33)]
    want = [x * 4 for x in xs]
    found = aiak.ops.multi_tensor_scale_(xs, xs, 4.0)
    assert found.item() == 0.0
    for x, w in zip(xs, want):
        assert torch.equal(x, w)
    xs[1][5] = float("nan")
    aiak.ops.multi_tensor_scale_(xs, xs, 1.0, found)
    assert found.item() == 1.0
    aiak.ops.multi_tensor_scale_([torch.ones(3)], [torch.ones(3)], 1.0, found)
    assert found.item() == 1.0  # never cleared by the op


def test_scale_pairs_match_by_element_count() -> None:
    src = torch.randn(3, 4)
    flat = torch.empty(12, dtype=torch.float16)  # a flat half copy of a shaped fp32 tensor
    aiak.ops.multi_tensor_scale_([src], [flat], 2.0)
    assert torch.equal(flat, (src.reshape(-1) * 2).half())


def test_scale_keeps_layout_of_channels_last() -> None:
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = torch.empty_like(x)  # same strides
    aiak.ops.multi_tensor_scale_([x], [y], 2.0)
    assert torch.equal(y, x * 2)


def _scale(src, dst, scale=None, found=None):
    scale = torch.ones((), dtype=torch.float32) if scale is None else scale
    found = torch.zeros(1) if found is None else found
    torch.ops.aiak.multi_tensor_scale_(src, dst, scale, found)


def _cuda_set(sizes: list[int], dtype: torch.dtype, unaligned: bool = False) -> list[torch.Tensor]:
    out = []
    for n in sizes:
        off = 3 if unaligned else 0
        out.append(torch.randn(n + off, device="cuda").to(dtype)[off:])
    return out


EDGE_SIZES = [0, 1, 7, 8, 65535, 65536, 65537, 131075, 1_000_003]


@pytest.mark.cuda
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_cuda_scale_bit_exact_with_reference(src: torch.dtype, dst: torch.dtype) -> None:
    for unaligned in (False, True):
        xs = _cuda_set(EDGE_SIZES, src, unaligned)
        xs[2][1] = float("inf")
        out = [torch.full_like(x, float("nan"), dtype=dst) for x in xs]
        s = torch.tensor(0.37, device="cuda")
        found = torch.zeros(1, device="cuda")
        torch.ops.aiak.multi_tensor_scale_(xs, out, s, found)
        for x, o in zip(xs, out):
            assert torch.equal(o, (x.float() * s).to(dst))
        assert found.item() == 1.0


@pytest.mark.cuda
def test_cuda_scale_in_place_on_side_stream_and_no_host_sync() -> None:
    xs = _cuda_set([100, 70_000, 5], torch.float32)
    want = [x * 3 for x in xs]
    s, found = torch.tensor(3.0, device="cuda"), torch.zeros(1, device="cuda")
    aiak.ops.multi_tensor_scale_(xs, xs, 1.0)  # warm: compile and build the table
    xs_copy = [x.clone() for x in xs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            torch.ops.aiak.multi_tensor_scale_(xs_copy, xs_copy, s, found)
            torch.ops.aiak.multi_tensor_l2norm(xs_copy, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(side)
    for x, w in zip(xs_copy, want):
        torch.testing.assert_close(x, w, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_kernel_writes_bump_version_counters() -> None:
    # A tensor saved for backward and then overwritten by the kernel must make backward raise,
    # as an in-place torch op would, not silently use the new values.
    x = torch.randn(100, device="cuda", requires_grad=True)
    y = x * 2
    z = (y * y).sum()  # saves y
    before = y._version
    aiak.ops.multi_tensor_scale_([y.detach()], [y.detach()], 3.0)
    assert y._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_reference_writes_bump_version_counters() -> None:
    y = torch.randn(10)
    before = y._version
    aiak.ops.multi_tensor_scale_([y], [y], 3.0)
    assert y._version > before
