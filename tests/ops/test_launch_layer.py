"""The CUDA launch layer's CPU-testable parts: sources, capabilities, the launcher's packing
(``cuLaunchKernelEx`` recorded instead of called)."""

from __future__ import annotations

import struct
import warnings

import pytest
import torch
from _recorder import Recorder

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


def test_capability_reasons_on_cpu_and_for_dtypes() -> None:
    cap = _capability.Capability("demo", dtypes=(torch.float32,))
    assert cap.not_supported_reasons(torch.device("cpu")) == [
        "demo: the kernel runs on cuda, not cpu"
    ]


def test_backends_reports_why_not() -> None:
    info = aiak.ops.backends()
    assert set(info) >= {"torch", "cuda", "cupy", "ops", "conditions"}
    assert "head_dim in (32, 64)" in info["conditions"]["window_attention"]
    assert set(info["conditions"]) >= {"fused_adam_", "fused_sgd_", "fused_lamb_"}
    assert set(info["ops"]) >= {"multi_tensor_l2norm", "multi_tensor_scale_"}
    if not torch.cuda.is_available():
        assert info["cuda"]["reason"] and all(
            v.startswith("reference") for v in info["ops"].values()
        )
    if not info["cupy"]["available"]:
        assert "cupy" in info["cupy"]["reason"]


def test_input_reasons_join_the_capability_and_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capability.Capability(
        "demo", input_reasons=lambda n: [f"demo: n = {n} > 4"] if n > 4 else []
    )
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_cuda, "cupy_unavailable_reason", lambda: None)
    monkeypatch.setattr(_cuda, "device_capability", lambda device: (9, 0))
    assert cap.not_supported_reasons(cuda, (torch.float32,), (5,)) == ["demo: n = 5 > 4"]
    assert cap.not_supported_reasons(cuda, (torch.float32,), (3,)) == []
    _capability.clear_warnings()
    assert _capability.use_kernel(cap, cuda, (torch.float32,), (3,))
    with pytest.warns(RuntimeWarning, match="demo: n = 5 > 4"):
        assert not _capability.use_kernel(cap, cuda, (torch.float32,), (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason set
        assert not _capability.use_kernel(cap, cuda, (torch.float32,), (5,))


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


def test_a_launch_packs_declared_types_on_torch_stream(recorder: Recorder) -> None:
    k = _driver.Kernel(
        "multi_tensor_l2norm.cu",
        "mt_l2norm",
        "ptr table, i32 T, ptr scratch, ptr per_tensor, ptr total",
    )
    t = torch.zeros(3)
    k(5, 256, t, 7, None, 0xABC0, t)
    k((5, 6), (16, 8), t, 7, None, 0, t, shared_mem=100 * 1024)
    k((5, 6, 7), (4,), t, -1, t, t, t)
    assert [launch["dims"] for launch in recorder.launches] == [
        (5, 1, 1, 256, 1, 1, 0),
        (5, 6, 1, 16, 8, 1, 100 * 1024),
        (5, 6, 7, 4, 1, 1, 0),
    ]
    assert all(launch["stream"] == 77 and launch["attr"] == () for launch in recorder.launches)
    first = recorder.launches[0]["args"]
    assert first == {
        "table": t.data_ptr(),
        "T": 7,
        "scratch": 0,
        "per_tensor": 0xABC0,
        "total": t.data_ptr(),
    }
    assert recorder.launches[2]["args"]["T"] == -1


def test_after_previous_launches_are_programmatic(recorder: Recorder) -> None:
    params = "ptr table, i32 T, i32 list, ptr found_inf"
    after = _driver.Kernel("fused_adam.cu", "bump_steps", params, after_previous=True)
    first = _driver.Kernel("fused_adam.cu", "bump_steps", params)
    first(2, 64, 0, 1, 4, None)
    after(3, 128, 0, 1, 4, None)
    # attribute 6 (programmatic stream serialization) set to 1 on the dependent launch only
    assert [launch["attr"] for launch in recorder.launches] == [(), (6, 1)]
    try:
        assert _driver.programmatic_launches(False) is True
        after(4, 32, 0, 1, 4, None)  # switched off: a plain launch
    finally:
        assert _driver.programmatic_launches(True) is False
    assert recorder.launches[-1]["attr"] == ()


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
def test_launch_numbers_that_would_wrap_are_refused(
    recorder: Recorder, grid, block, shared_mem, exc, match
) -> None:
    k = _driver.Kernel("fused_adam.cu", "bump_steps", "ptr table, i32 T, i32 list, ptr found_inf")
    with pytest.raises(exc, match=match):
        k(grid, block, 0, 1, 4, None, shared_mem=shared_mem)
    assert recorder.launches == []


@pytest.mark.parametrize(
    ("params", "values", "match"),
    [
        ("i32 n", (2**31,), r"k: n \(2147483648\) does not fit i32"),
        ("i32 n", (-(2**31) - 1,), "k: n "),
        ("ptr x, i64 n", (0, 2**63), r"k: n \(9223372036854775808\) does not fit i64"),
        ("ptr x", (-1,), "k: x "),
        ("i32 n", (1.5,), "k: n "),
        ("i32 a, i32 b", (1,), "k takes 2 arguments, got 1"),
    ],
)
def test_values_that_do_not_fit_their_type_are_refused(
    recorder: Recorder, params, values, match
) -> None:
    k = _driver.Kernel("a.cu", "k", params)
    k._handles[0] = 1  # loaded: no source to read
    with pytest.raises(ValueError, match=match):
        k(1, 1, *values)
    assert recorder.launches == []


def test_a_float_beyond_float32_packs_as_inf(recorder: Recorder) -> None:
    """C's conversion (and a float32 tensor's): not a wrap, and what cast_scale_ relies on."""
    k = _driver.Kernel("a.cu", "k", "f32 a, f64 b")
    k._handles[0] = 1
    k(1, 1, -1e39, 1e300)
    buf = k._local.slots[0]
    assert struct.unpack_from("@fd", buf) == (float("-inf"), 1e300)


def test_declarations_are_checked_against_the_source_at_load(recorder: Recorder) -> None:
    good = "ptr table, i32 T, i32 list, ptr found_inf"
    _driver.Kernel("fused_adam.cu", "bump_steps", good)(1, 1, 0, 1, 4, None)
    bad = _driver.Kernel("fused_adam.cu", "bump_steps", "ptr table, i64 T, i32 list, ptr found_inf")
    with pytest.raises(
        TypeError,
        match=r"bump_steps: declared \(ptr table, i64 T.*fused_adam.cu has \(ptr table, i32 T",
    ):
        bad(1, 1, 0, 1, 4, None)
    missing = _driver.Kernel("fused_adam.cu", "no_such_kernel", "ptr x")
    with pytest.raises(TypeError, match="has no extern"):
        missing(1, 1, None)
    with pytest.raises(ValueError, match="a kernel parameter is"):
        _driver.Kernel("fused_adam.cu", "bump_steps", "ptr table, int T")
    assert len(recorder.launches) == 1
