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


def test_i32_refuses_values_that_do_not_fit() -> None:
    assert _cuda.i32(7) == np.int32(7)
    with pytest.raises(ValueError, match="does not fit in 32 bits"):
        _cuda.i32(2**31)


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
    from aiak.ops import _registry
    from aiak.ops.multi_tensor_l2norm import L2NORM_OP

    ts = [torch.randn(5), torch.randn(3, 2)]
    with torch.enable_grad():
        assert L2NORM_OP.eager_kernel((ts, True)) is L2NORM_OP.reference
        total, per = aiak.ops.multi_tensor_l2norm(ts, True)
        assert per.shape == (2,) and per.grad_fn is None
        assert total.grad_fn is None and not total.requires_grad
        leaf = torch.randn(4, requires_grad=True)
        assert L2NORM_OP.eager_kernel(([ts[0], leaf], True)) is None
        assert _registry._any_requires_grad(((ts[0], leaf), False))
        assert _registry._any_requires_grad((leaf,))
        assert not _registry._any_requires_grad((ts, 1.0, None))
        total2, _ = aiak.ops.multi_tensor_l2norm([ts[0], leaf], True)
        total2.backward()
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts]))
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(leaf.grad, leaf.detach() / total2.detach())
    with torch.no_grad():
        assert L2NORM_OP.eager_kernel(([ts[0], leaf], True)) is L2NORM_OP.reference


def test_driver_kernel_fallback_argument_types() -> None:
    """Without a driver handle, DriverKernel passes CuPy numpy scalars of the kernel's types."""
    import ctypes

    assert _driver._numpy_type(ctypes.c_uint64) is np.uint64
    assert _driver._numpy_type(ctypes.c_int64) is np.int64
    assert _driver._numpy_type(ctypes.c_int32) is np.int32
    assert _driver._numpy_type(ctypes.c_uint32) is np.uint32
    assert _driver._numpy_type(ctypes.c_float) is np.float32
    assert _driver._numpy_type(ctypes.c_double) is np.float64
    seen = []
    k = _driver.DriverKernel.__new__(_driver.DriverKernel)
    k._ptr, k._argtypes = None, (ctypes.c_uint64, ctypes.c_float, ctypes.c_int64)
    k._cupy_fn = lambda grid, block, args, stream: seen.append((grid, block, args))
    import unittest.mock

    with unittest.mock.patch.object(_cuda, "current_stream", lambda: None):
        k(3, 128, 2**40, 0.5, 7)
    ((grid, block, args),) = seen
    assert grid == (3,) and block == (128,)
    assert [type(a) for a in args] == [np.uint64, np.float32, np.int64]
    assert [int(args[0]), float(args[1]), int(args[2])] == [2**40, 0.5, 7]
