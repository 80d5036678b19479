"""The CUDA launch layer's CPU-testable parts: sources, options, shims, capabilities."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import aiak.ops
from aiak.ops import _capability, _cuda, _driver


def test_kernel_source_inlines_local_headers_once() -> None:
    text = _cuda.kernel_source("multi_tensor_l2norm.cu")
    assert '#include "' not in text and "#pragma once" not in text
    assert text.count("struct ChunkRef {") == 1
    with pytest.raises(FileNotFoundError, match="no kernel source"):
        _cuda.kernel_source("missing.cu")


def test_kernels_disabled_parses_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIAK_DISABLE_KERNELS", "1")
    assert _cuda.kernels_disabled()
    monkeypatch.setenv("AIAK_DISABLE_KERNELS", "yes")
    with pytest.raises(ValueError, match="AIAK_DISABLE_KERNELS must be 0 or 1"):
        _cuda.kernels_disabled()


def test_numba_shim_restores_row_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    # numba-cuda 0.30.4 calls np.row_stack, gone in numpy 2.5: the shim aliases it to vstack.
    monkeypatch.delattr(np, "row_stack", raising=False)
    fake = types.ModuleType("numba.cuda")
    monkeypatch.setitem(sys.modules, "numba.cuda", fake)
    monkeypatch.setitem(sys.modules, "numba", types.ModuleType("numba"))
    assert _cuda.import_numba_cuda() is fake
    assert np.row_stack is np.vstack


def test_capability_reasons_on_cpu_and_for_dtypes() -> None:
    cap = _capability.Capability("demo", dtypes=(torch.float32,))
    assert cap.not_supported_reasons(torch.device("cpu")) == [
        "demo: the kernel runs on cuda, not cpu"
    ]


def test_backends_reports_why_not() -> None:
    info = aiak.ops.backends()
    assert set(info) >= {"torch", "cuda", "cupy", "numba_cuda", "ops"}
    assert set(info["ops"]) >= {"multi_tensor_l2norm", "multi_tensor_scale_"}
    if not torch.cuda.is_available():
        assert info["cuda"]["reason"] and all(
            v.startswith("reference") for v in info["ops"].values()
        )
    if not info["cupy"]["available"]:
        assert "cupy" in info["cupy"]["reason"]


def test_is_dense() -> None:
    x = torch.randn(4, 5, 6)
    assert _capability.is_dense(x) and _capability.is_dense(x.permute(2, 0, 1))
    assert not _capability.is_dense(x[:, ::2]) and not _capability.is_dense(x.expand(2, 4, 5, 6))


def test_grad_mode_alone_keeps_the_eager_fast_path() -> None:
    """A differentiable op under grad mode goes to the dispatcher (autograd) only when an
    input requires grad; otherwise the fast path gives the same values and no graph."""
    from aiak.ops import _host
    from aiak.ops.multi_tensor_l2norm import L2NORM_OP

    ts = [torch.randn(5), torch.randn(3, 2)]
    with torch.enable_grad():
        assert L2NORM_OP.eager_kernel((ts, True)) is L2NORM_OP.reference
        total, per = aiak.ops.multi_tensor_l2norm(ts, True)
        assert per.shape == (2,) and per.grad_fn is None
        assert total.grad_fn is None and not total.requires_grad
        leaf = torch.randn(4, requires_grad=True)
        assert L2NORM_OP.eager_kernel(([ts[0], leaf], True)) is None
        assert _host.any_requires_grad(((ts[0], leaf), False))
        assert _host.any_requires_grad((leaf,))
        assert not _host.any_requires_grad((ts, 1.0, None))
        total2, _ = aiak.ops.multi_tensor_l2norm([ts[0], leaf], True)
        total2.backward()
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts]))
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(leaf.grad, leaf.detach() / total2.detach())
    with torch.no_grad():
        assert L2NORM_OP.eager_kernel(([ts[0], leaf], True)) is L2NORM_OP.reference


class _StandIn:
    """A CuPy RawKernel without a driver handle: records what CuPy would be asked to launch."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, grid, block, args, shared_mem=0, stream=None) -> None:
        self.calls.append((grid, block, args, shared_mem))


def test_driver_kernel_fallback_argument_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a driver handle, DriverKernel hands CuPy numpy scalars of the kernel's types
    and the same grid, block and shared memory."""
    import ctypes

    assert _driver._numpy_type(ctypes.c_uint64) is np.uint64
    assert _driver._numpy_type(ctypes.c_int64) is np.int64
    assert _driver._numpy_type(ctypes.c_int32) is np.int32
    assert _driver._numpy_type(ctypes.c_uint32) is np.uint32
    assert _driver._numpy_type(ctypes.c_float) is np.float32
    assert _driver._numpy_type(ctypes.c_double) is np.float64
    monkeypatch.setattr(_cuda, "current_stream", lambda: None)
    fn = _StandIn()
    k = _driver.DriverKernel(fn, (ctypes.c_uint64, ctypes.c_float, ctypes.c_int64))
    assert k._ptr is None
    k(3, 128, 2**40, 0.5, 7)
    k((3, 2), (32, 4, 2), 1, 0.25, -(2**40), shared_mem=70000)
    (g1, b1, args, smem1), (g2, b2, args2, smem2) = fn.calls
    assert (g1, b1, smem1) == ((3, 1, 1), (128, 1, 1), 0)
    assert (g2, b2, smem2) == ((3, 2, 1), (32, 4, 2), 70000)
    assert [type(a) for a in args] == [np.uint64, np.float32, np.int64]
    assert [int(args[0]), float(args[1]), int(args[2])] == [2**40, 0.5, 7]
    assert int(args2[2]) == -(2**40)
    # the fallback checks values as the driver path does: nothing wraps
    with pytest.raises(ValueError, match=r"probe: argument 0 \(-1\) does not fit c_ulong"):
        k(1, 1, -1, 0.5, 7)
    assert len(fn.calls) == 2


def _recording_driver(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    seen: list[tuple] = []

    def cu_launch_kernel(ptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> int:
        seen.append((ptr, (gx, gy, gz), (bx, by, bz), smem, stream, len(params)))
        return 0

    monkeypatch.setattr(_driver, "_driver", lambda: cu_launch_kernel)
    monkeypatch.setattr(_driver, "_driver_ex", lambda: None)  # a driver without it
    monkeypatch.setattr(_cuda, "device_index", lambda: 0)
    monkeypatch.setattr(_cuda, "raw_stream", lambda device: 77)
    return seen


def test_driver_kernel_passes_grid_block_and_shared_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes

    seen = _recording_driver(monkeypatch)
    fn = _StandIn()
    fn.kernel = types.SimpleNamespace(ptr=0xABC)
    k = _driver.DriverKernel(fn, (ctypes.c_uint64, ctypes.c_int32))
    k(5, 256, 1, 2)
    k((5, 6), (16, 8), 1, 2, shared_mem=100 * 1024)
    k((5, 6, 7), (4,), 1, 2)
    assert seen == [
        (0xABC, (5, 1, 1), (256, 1, 1), 0, 77, 2),
        (0xABC, (5, 6, 1), (16, 8, 1), 100 * 1024, 77, 2),
        (0xABC, (5, 6, 7), (4, 1, 1), 0, 77, 2),
    ]
    assert fn.calls == []


def test_after_previous_launches_through_cu_launch_kernel_ex(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes

    plain = _recording_driver(monkeypatch)
    ex: list[tuple] = []

    def cu_launch_kernel_ex(config, ptr, params, extra) -> int:
        *dims, stream, attrs, nattrs = _driver.LAUNCH_CONFIG.unpack_from(config)
        attr = ()
        if nattrs:
            raw = ctypes.string_at(attrs, _driver.LAUNCH_ATTRIBUTE.size)
            attr = _driver.LAUNCH_ATTRIBUTE.unpack(raw)
        ex.append((ptr, tuple(dims), stream, nattrs, attr, len(params)))
        return 0

    monkeypatch.setattr(_driver, "_driver_ex", lambda: cu_launch_kernel_ex)
    monkeypatch.setattr(_driver, "_dependent_launch_ok", lambda device: True)
    fn = _StandIn()
    fn.kernel = types.SimpleNamespace(ptr=0xABC)
    after = _driver.DriverKernel(fn, (ctypes.c_uint64,), after_previous=True)
    first = _driver.DriverKernel(fn, (ctypes.c_uint64,))
    first(2, 64, 1)
    after(3, 128, 1)
    after((3, 2), 32, 1, shared_mem=4096)
    # every launch goes through cuLaunchKernelEx on torch's stream; the dependent ones carry
    # attribute 6 (programmatic stream serialization) set to 1
    assert ex == [
        (0xABC, (2, 1, 1, 64, 1, 1, 0), 77, 0, (), 1),
        (0xABC, (3, 1, 1, 128, 1, 1, 0), 77, 1, (6, 1), 1),
        (0xABC, (3, 2, 1, 32, 1, 1, 4096), 77, 1, (6, 1), 1),
    ]
    try:
        assert _driver.programmatic_launches(False) is True
        after(4, 32, 1)  # switched off: a plain launch
    finally:
        assert _driver.programmatic_launches(True) is False
    assert ex[-1] == (0xABC, (4, 1, 1, 32, 1, 1, 0), 77, 0, (), 1)
    monkeypatch.setattr(_driver, "_dependent_launch_ok", lambda device: False)  # before sm_90
    after(5, 32, 1)
    assert ex[-1] == (0xABC, (5, 1, 1, 32, 1, 1, 0), 77, 0, (), 1)
    assert plain == []


def test_launch_config_layouts_match_cuda_h(tmp_path) -> None:
    import shutil
    import subprocess
    from pathlib import Path

    include = Path("/usr/local/cuda/include")
    gcc = shutil.which("gcc")
    if gcc is None or not (include / "cuda.h").exists():
        pytest.skip("gcc and cuda.h are needed to read the layouts")
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\n"
        'int main(void) { printf("%zu %zu %zu %zu %zu %zu %zu %d", sizeof(CUlaunchConfig),'
        " offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),"
        " offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),"
        " offsetof(CUlaunchAttribute, value), offsetof(CUlaunchAttribute, id),"
        " (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION); return 0; }\n"
    )
    exe = tmp_path / "layout"
    subprocess.run([gcc, f"-I{include}", str(src), "-o", str(exe)], check=True, timeout=120)
    got = [
        int(v)
        for v in subprocess.run(
            [str(exe)], capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    ]
    cfg, attr = _driver.LAUNCH_CONFIG, _driver.LAUNCH_ATTRIBUTE
    # ours: 7 launch numbers, then the stream, the attribute array and its length
    assert got == [
        cfg.size,
        28 + 4,
        40,
        48,
        attr.size,
        8,
        0,
        _driver._PROGRAMMATIC_STREAM_SERIALIZATION,
    ]


@pytest.mark.parametrize(
    ("grid", "block", "shared_mem", "exc", "match"),
    [
        (0, 32, 0, ValueError, "grid dimensions must be in"),
        (2**32 + 1, 32, 0, ValueError, "grid dimensions must be in"),  # would wrap to 1
        ((4, -1), 32, 0, ValueError, "grid dimensions must be in"),
        (4, (1, 1, 1, 1), 0, TypeError, "block must be an int or a tuple of 1 to 3 ints"),
        (4, 32.0, 0, TypeError, "block must be an int"),
        ((), 32, 0, TypeError, "grid must be"),
        (4, 32, -1, ValueError, "shared_mem must be an int in"),
        (4, 32, 2**32, ValueError, "shared_mem must be an int in"),
    ],
)
def test_driver_kernel_refuses_launch_numbers_that_would_wrap(
    monkeypatch: pytest.MonkeyPatch, grid, block, shared_mem, exc, match
) -> None:
    import ctypes

    seen = _recording_driver(monkeypatch)
    fn = _StandIn()
    fn.kernel = types.SimpleNamespace(ptr=1)
    k = _driver.DriverKernel(fn, (ctypes.c_int32,))
    with pytest.raises(exc, match=match):
        k(grid, block, 1, shared_mem=shared_mem)
    assert seen == []


@pytest.mark.parametrize(
    ("argtypes", "values", "match"),
    [
        (("c_int32",), (2**31,), r"argument 0 \(2147483648\) does not fit c_int"),
        (("c_int32",), (-(2**31) - 1,), "argument 0"),
        (("c_uint64", "c_int64"), (0, 2**63), r"argument 1 \(9223372036854775808\)"),
        (("c_uint64",), (-1,), "argument 0"),
        (("c_int32",), (1.5,), "argument 0"),
        (("c_int32", "c_int32"), (1,), "probe takes 2 arguments, got 1"),
    ],
)
def test_driver_kernel_refuses_values_that_do_not_fit(
    monkeypatch: pytest.MonkeyPatch, argtypes, values, match
) -> None:
    import ctypes

    seen = _recording_driver(monkeypatch)
    fn = _StandIn()
    fn.kernel = types.SimpleNamespace(ptr=1)
    k = _driver.DriverKernel(fn, tuple(getattr(ctypes, t) for t in argtypes))
    with pytest.raises(ValueError, match=match):
        k(1, 1, *values)
    assert seen == []


def test_a_float_beyond_float32_packs_as_inf(monkeypatch: pytest.MonkeyPatch) -> None:
    """C's conversion (and a float32 tensor's): not a wrap, and what cast_scale_ relies on."""
    import ctypes
    import struct

    _recording_driver(monkeypatch)
    fn = _StandIn()
    fn.kernel = types.SimpleNamespace(ptr=1)
    k = _driver.DriverKernel(fn, (ctypes.c_float, ctypes.c_double))
    k(1, 1, -1e39, 1e300)
    buf = k._local.slots[0]
    assert struct.unpack_from("@fd", buf) == (float("-inf"), 1e300)


def test_argtype_keeps_numpy_scalar_types() -> None:
    import ctypes

    assert _driver.argtype(torch.zeros(1)) is ctypes.c_uint64
    assert _driver.argtype(torch.nn.Parameter(torch.zeros(1))) is ctypes.c_uint64
    assert _driver.argtype(None) is ctypes.c_uint64
    assert _driver.argtype(3) is ctypes.c_int32
    assert _driver.argtype(True) is ctypes.c_int32
    assert _driver.argtype(0.5) is ctypes.c_float
    assert _driver.argtype(np.int32(3)) is ctypes.c_int32
    assert _driver.argtype(np.int64(3)) is ctypes.c_int64
    assert _driver.argtype(np.uint32(3)) is ctypes.c_uint32
    assert _driver.argtype(np.uint64(3)) is ctypes.c_uint64
    assert _driver.argtype(np.float32(0.5)) is ctypes.c_float
    # np.float64 is a subclass of float, and still a double
    assert _driver.argtype(np.float64(0.5)) is ctypes.c_double
    for bad in (np.int16(1), "1", ctypes.c_int64(1), 1j):
        with pytest.raises(TypeError, match="a kernel argument must be"):
            _driver.argtype(bad)


def test_run_kernel_makes_one_kernel_per_source_name_options_and_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes

    seen = _recording_driver(monkeypatch)
    compiled = []

    def get_function(source, name, options=_cuda.DEFAULT_OPTIONS):
        compiled.append((source, name, options))
        fn = _StandIn()
        fn.kernel = types.SimpleNamespace(ptr=len(compiled))
        return fn

    monkeypatch.setattr(_cuda, "get_function", get_function)
    monkeypatch.setattr(_driver, "_launchers", {})
    t = torch.zeros(2)
    opts = ("-std=c++17", "--fmad=false")
    _driver.run_kernel("a.cu", "k", (2, 3), 64, t, None, 1, 0.5, np.int64(2**40), np.float64(0.1))
    _driver.run_kernel("a.cu", "k", 1, 64, t, t, 2, 1.5, np.int64(3), np.float64(0.2))
    _driver.run_kernel("a.cu", "k", 1, 64, t, t, 2, 1.5, np.int64(3), np.float64(0.2), options=opts)
    monkeypatch.setattr(_cuda, "device_index", lambda: 1)
    _driver.run_kernel("a.cu", "k", 1, 64, t, t, 2, 1.5, np.int64(3), np.float64(0.2))
    default = ("a.cu", "k", _cuda.DEFAULT_OPTIONS)
    assert compiled == [default, ("a.cu", "k", opts), default]  # once per key
    assert [k[2:] for k in _driver._launchers] == [
        (_cuda.DEFAULT_OPTIONS, 0),
        (opts, 0),
        (_cuda.DEFAULT_OPTIONS, 1),
    ]
    kernel = next(iter(_driver._launchers.values()))
    assert kernel._argtypes == (
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_int64,
        ctypes.c_double,
    )
    assert [s[1:4] for s in seen] == [((2, 3, 1), (64, 1, 1), 0)] + [((1, 1, 1), (64, 1, 1), 0)] * 3
    assert [s[0] for s in seen] == [1, 1, 2, 3]  # each launch on its kernel's handle
