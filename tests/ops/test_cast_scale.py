"""aiak::cast_scale_: reference semantics, errors, opcheck, and the CUDA kernel bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aiak.ops
from aiak.ops import cast_scale as cs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAIRS = [(s, d) for s in DTYPES for d in DTYPES]


def _expected(src: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    # fp32 product rounded once: computed in float64 from the fp32 operands and rounded to
    # fp32 (exact: a product of two fp32 values fits float64), then to the target dtype.
    s32 = torch.tensor(scale, dtype=torch.float32).double()
    return (src.double().cpu() * s32).float().to(dtype)


# --------------------------------------------------------------------------------------------
# Reference path (CPU)
# --------------------------------------------------------------------------------------------


@given(
    n=st.integers(0, 3000),
    pair=st.sampled_from(PAIRS),
    scale=st.sampled_from([1.0, 10.0, 0.1, 1 / 1024, 65504.0]),
)
def test_reference_computes_in_fp32_and_rounds_once(n, pair, scale) -> None:
    src_dtype, dst_dtype = pair
    src = (torch.randn(n) * 1e-3).to(src_dtype)
    dst = torch.full((n,), float("nan"), dtype=dst_dtype)
    assert aiak.ops.cast_scale_(dst, src, scale) is dst
    assert torch.equal(dst, _expected(src, dst_dtype, scale))


def test_scale_rescues_fp16_underflow_and_back() -> None:
    # Perseus's gradient scale: 1e-8 flushes to 0 in fp16; x 1e4 survives, / 1e4 restores it.
    g = torch.full((16,), 1e-8)
    wire = torch.empty(16, dtype=torch.float16)
    assert not aiak.ops.cast_scale_(wire, g, 1.0).any()
    aiak.ops.cast_scale_(wire, g, 1e4)
    back = aiak.ops.cast_scale_(torch.empty(16), wire, 1e-4)
    torch.testing.assert_close(back, g, rtol=1e-3, atol=0)


def test_shapes_may_differ_with_equal_counts_and_in_place_works() -> None:
    src = torch.randn(6, 5)
    dst = torch.empty(30, dtype=torch.bfloat16)
    aiak.ops.cast_scale_(dst, src, 2.0)
    assert torch.equal(dst, (src * 2).reshape(-1).bfloat16())
    x = torch.randn(7)
    ref = x * 3
    aiak.ops.cast_scale_(x, x, 3.0)
    assert torch.equal(x, ref)


def test_non_finite_values_pass_through() -> None:
    src = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e5])
    dst = aiak.ops.cast_scale_(torch.empty(4, dtype=torch.float16), src, 1.0)
    assert dst[0].isnan() and dst[1] == float("inf") and dst[2] == -float("inf")
    assert dst[3] == float("inf")  # 1e5 overflows fp16, as .half() does


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: (torch.empty(4), torch.empty(5)), ValueError, "dst has 4 elements"),
        (lambda: (torch.empty(4, dtype=torch.int32), torch.empty(4)), TypeError, "dst has dtype"),
        (lambda: (torch.empty(4), torch.empty(4, dtype=torch.float64)), TypeError, "src has"),
        (lambda: (torch.empty(4, 2).t(), torch.empty(8)), ValueError, "dst must be contiguous"),
        (lambda: (torch.empty(4), torch.empty(8)[::2]), ValueError, "src must be contiguous"),
        (lambda: ("x", torch.empty(4)), TypeError, "dst must be a tensor"),
    ],
)
def test_bad_arguments_are_named(make, exc, match) -> None:
    dst, src = make()
    with pytest.raises(exc, match=match):
        aiak.ops.cast_scale_(dst, src, 1.0)


def test_overlapping_src_and_dst_are_refused() -> None:
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match="overlap"):
        aiak.ops.cast_scale_(buf[1:5], buf[:4], 1.0)
    half = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="overlap"):  # same address, other dtype: not in place
        aiak.ops.cast_scale_(half.view(torch.bfloat16), half, 1.0)


def test_scale_must_be_a_number() -> None:
    with pytest.raises(TypeError, match="scale must be a number"):
        aiak.ops.cast_scale_(torch.empty(2), torch.empty(2), torch.tensor(2.0))


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS[:4])
def test_opcheck(src_dtype, dst_dtype) -> None:
    dst = torch.empty(33, dtype=dst_dtype)
    src = torch.randn(33).to(src_dtype)
    torch.library.opcheck(torch.ops.aiak.cast_scale_.default, (dst, src, 3.0))


# --------------------------------------------------------------------------------------------
# CUDA kernel
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096 * 8 + 5, 3_000_001])
def test_cuda_kernel_equals_the_reference_bit_for_bit(src_dtype, dst_dtype, n) -> None:
    assert aiak.ops.backends()["ops"]["cast_scale_"] == "cupy"
    src = (torch.randn(n, device="cuda") * 1e-3).to(src_dtype)
    dst = torch.full((n,), float("nan"), dtype=dst_dtype, device="cuda")
    aiak.ops.cast_scale_(dst, src, 10.0)
    assert torch.equal(dst.cpu(), _expected(src, dst_dtype, 10.0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_keeps_fp32_subnormals(dtype) -> None:
    # CuPy compiles with -ftz=true; the kernel's multiply must not flush: bf16's smallest
    # normal / 1024 is an fp32 subnormal, and so is fp32's.
    tiny = torch.finfo(dtype).tiny
    src = torch.tensor([tiny, 3 * tiny, -tiny] * 11, dtype=dtype, device="cuda")
    out = torch.empty(33, device="cuda")
    aiak.ops.cast_scale_(out, src, 1 / 1024)
    assert torch.equal(out.cpu(), _expected(src, torch.float32, 1 / 1024))
    assert (out != 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [1, 3, 4, 8])
def test_cuda_kernel_handles_unaligned_views(offset) -> None:
    # Views at odd offsets cannot take the vector path: the scalar loop covers them.
    base = torch.randn(10_000 + offset, device="cuda")
    src = base[offset:]
    wire = torch.empty(10_000 + offset, dtype=torch.float16, device="cuda")[offset:]
    aiak.ops.cast_scale_(wire, src, 0.5)
    assert torch.equal(wire.cpu(), _expected(src, torch.float16, 0.5))


@pytest.mark.cuda
def test_cuda_kernel_runs_on_the_current_stream_and_bumps_the_version() -> None:
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty(1 << 20, dtype=torch.float16, device="cuda")
    version = dst._version
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        aiak.ops.cast_scale_(dst, src, 2.0)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(dst, (src * 2).half())
    assert dst._version > version


@pytest.mark.cuda
def test_cuda_launch_from_a_fresh_thread_and_a_side_stream() -> None:
    """The driver launch binds the context in a thread that has made no CUDA call, and runs on
    the thread's current stream."""
    import threading

    src = torch.randn(100_003, device="cuda")
    expected = torch.empty(100_003, dtype=torch.float16, device="cuda")
    cs._reference(expected, src, 3.0)
    out: dict[str, torch.Tensor] = {}

    def work() -> None:
        side = torch.cuda.Stream()
        dst = torch.empty(100_003, dtype=torch.float16, device="cuda")
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.default_stream())
            aiak.ops.cast_scale_(dst, src, 3.0)
        side.synchronize()
        out["dst"] = dst

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert torch.equal(out["dst"], expected)


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [1e40, -1e300, float("inf"), float("nan")])
def test_cuda_scale_beyond_fp32_is_what_the_reference_gives(scale) -> None:
    src = torch.tensor([0.0, 1.0, -2.0, 1e-30] * 8, device="cuda")
    got = torch.empty(32, device="cuda")
    aiak.ops.cast_scale_(got, src, scale)
    expected = torch.empty(32, device="cuda")
    cs._reference(expected, src, scale)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
