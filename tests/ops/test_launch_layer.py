"""The CUDA launch layer's CPU-testable parts: sources, options, shims, capabilities."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import aiak.ops
from aiak.ops import _capability, _cuda


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
