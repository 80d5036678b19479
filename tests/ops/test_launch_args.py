"""Every launch's arguments against its kernel's C signature, on the CPU.

A kernel parameter read as the wrong type (int32 for int64, float for double, a missing or
extra argument) gives no error on the GPU, only wrong numbers. Here the ``extern "C"
__global__`` signatures are parsed from ``ops/kernels/*.cu`` (macro-made kernels included), and
each call site's launches run through ``_driver.DriverKernel`` as on CUDA, with a recording
``cuLaunchKernel`` in place of libcuda: the test reads every parameter back from the packed
buffer at the pointer the driver would read, with the type the kernel declares, and checks
the parameter count, each type's kind and size, and named values.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from aiak.ops import _cuda, _driver
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import fcos3d as fcos3d_mod
from aiak.ops import window_partition as wp
from aiak.ops._simota_cuda import launch_simota

# --------------------------------------------------------------------------------------------
# The kernels' signatures, from the CUDA sources
# --------------------------------------------------------------------------------------------

_GLOBAL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?(\w+)\s*\(([^)]*)\)'
)
_MACRO = re.compile(r"^[ \t]*#define[ \t]+(\w+)\(([^)]*)\)(.*)$", re.MULTILINE)
_TYPEDEF = re.compile(r"\btypedef\s+([\w ]+?)\s+(\w+)\s*;")
_BASE = {
    "int": ("int", 4),
    "long long": ("int", 8),
    "unsigned int": ("uint", 4),
    "unsigned": ("uint", 4),
    "unsigned long long": ("uint", 8),
    "float": ("float", 4),
    "double": ("float", 8),
}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "ptr", "int", "uint" or "float"
    size: int


def _param(text: str, typedefs: dict[str, str]) -> Param:
    words = re.findall(r"\w+|\*", text)
    name = words[-1]
    if "*" in words:
        return Param(name, "ptr", 8)
    base = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "volatile"))
    base = typedefs.get(base, base)
    if base not in _BASE:
        raise AssertionError(f"unknown kernel parameter type {base!r} in {text!r}")
    return Param(name, *_BASE[base])


def kernel_signatures(filename: str) -> dict[str, tuple[Param, ...]]:
    """``{kernel name: its parameters}`` of every ``extern "C" __global__`` kernel of
    ``ops/kernels/<filename>``, those written by function-like macros included."""
    return signatures(_cuda.kernel_source(filename))


def signatures(source: str) -> dict[str, tuple[Param, ...]]:
    text = source.replace("\\\n", " ")  # splice lines, then drop comments, as C does
    text = re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", text), flags=re.DOTALL)
    typedefs = {alias: base for base, alias in _TYPEDEF.findall(text)}
    expanded = []
    for name, params, body in _MACRO.findall(text):
        if "__global__" not in body:
            continue
        formals = [p.strip() for p in params.split(",")]
        for actuals in re.findall(rf"^[ \t]*{name}\(([^)]*)\)", text, re.MULTILINE):
            values = dict(zip(formals, (a.strip() for a in actuals.split(","))))
            expanded.append(re.sub(r"\w+", lambda m, v=values: v.get(m[0], m[0]), body))
    plain = _MACRO.sub("", text)
    out = {}
    for name, params in _GLOBAL.findall(plain + "\n".join(expanded)):
        out[name] = tuple(_param(p, typedefs) for p in params.split(",") if p.strip())
    return out


def _shape(ctype: Any) -> tuple[str, int]:
    if ctype in (ctypes.c_float, ctypes.c_double):
        return "float", ctypes.sizeof(ctype)
    return ("int" if ctype(-1).value == -1 else "uint"), ctypes.sizeof(ctype)


def assert_argtypes_match(where: str, argtypes: tuple[Any, ...], params: tuple[Param, ...]) -> None:
    assert len(argtypes) == len(params), (
        f"{where}: {len(argtypes)} arguments for {len(params)} parameters"
    )
    for ctype, p in zip(argtypes, params):
        want = ("uint", 8) if p.kind == "ptr" else (p.kind, p.size)
        assert _shape(ctype) == want, f"{where}: {p.name} is {p.kind}{8 * p.size}, not {ctype}"


def test_signatures_are_found_for_every_kernel_in_the_sources() -> None:
    # kernels written by macros: 16 attention kernels and 5 gathers; one per dtype pair
    macro_made = {"window_attention.cu": 21, "cast_scale.cu": 9}
    for path in sorted(_cuda.KERNEL_DIR.glob("*.cu")):
        sigs = kernel_signatures(path.name)
        expected = macro_made.get(path.name, path.read_text().count('extern "C"'))
        assert len(sigs) == expected, path.name
    wa = kernel_signatures("window_attention.cu")
    assert len([n for n in wa if n.startswith("window_attention_")]) == 16
    assert [p.name for p in wa["window_gather_4"]][-3:] == ["units", "total", "merge"]
    assert wa["window_gather_4"][-2] == Param("total", "int", 8)
    assert wa["window_attention_mma_fwd_f16_d32"][-1] == Param("scale", "float", 4)
    assert kernel_signatures("simota.cu")["simota_select"][16] == Param("radius", "float", 8)


def test_the_parser_reads_types_names_and_macros() -> None:
    src = """typedef long long i64;
// extern "C" __global__ void commented_out(int a) {}
#define K(NAME, T)                                \\
  extern "C" __global__ void NAME(const T* __restrict__ x, i64 n, double r, unsigned m) {}
K(k_f32, float)
K(k_f16, half)
extern "C" __global__ void __launch_bounds__(256) plain(float s, int* out) {}
"""
    sigs = signatures(src)
    assert set(sigs) == {"k_f32", "k_f16", "plain"}
    assert sigs["k_f16"] == (
        Param("x", "ptr", 8),
        Param("n", "int", 8),
        Param("r", "float", 8),
        Param("m", "uint", 4),
    )
    assert sigs["plain"] == (Param("s", "float", 4), Param("out", "ptr", 8))
    with pytest.raises(AssertionError, match="unknown kernel parameter type"):
        _param("short x", {})


# --------------------------------------------------------------------------------------------
# Kernels with argument types written out by hand
# --------------------------------------------------------------------------------------------


def test_typed_tables_match_the_kernels() -> None:
    from aiak.ops import _dgc_select_cuda as dgc
    from aiak.ops import cast_scale

    sigs = kernel_signatures("dgc_select.cu")
    for name, argtypes in dgc._ARGTYPES.items():
        assert_argtypes_match(name, argtypes, sigs[name])
    sigs = kernel_signatures("cast_scale.cu")
    for name in set(cast_scale._NAMES.values()):
        assert_argtypes_match(name, cast_scale._ARGTYPES, sigs[name])


# --------------------------------------------------------------------------------------------
# Call sites, run on the CPU through DriverKernel with a recording driver
# --------------------------------------------------------------------------------------------

_DECODE = {("ptr", 8): "Q", ("int", 4): "i", ("int", 8): "q", ("uint", 4): "I"}
_DECODE.update({("uint", 8): "Q", ("float", 4): "f", ("float", 8): "d"})


class _Handle:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Function:
    """Stands in for a CuPy RawKernel: a driver handle and the attributes launchers set."""

    def __init__(self, source: str, name: str, options: tuple[str, ...], ptr: int) -> None:
        self.source, self.name, self.options = source, name, options
        self.kernel = _Handle(ptr)
        self.num_regs = 96
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.preferred_shared_memory_carveout = -1


@dataclass
class Launch:
    fn: _Function
    dims: tuple[int, ...]
    args: dict[str, Any]  # parameter name -> value read back with the kernel's type
    values: tuple  # what the call site packed


@dataclass
class Recorder:
    functions: dict[tuple[str, str], _Function] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    _pending: list[tuple] = field(default_factory=list)

    def get_function(self, source: str, name: str, options=_cuda.DEFAULT_OPTIONS) -> _Function:
        key = (source, name)
        if key not in self.functions:
            self.functions[key] = _Function(source, name, options, 0x1000 + len(self.functions))
        fn = self.functions[key]
        assert fn.options == options, f"{name} compiled with two option sets"
        return fn

    def cu_launch_kernel(self, ptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> int:
        (fn,) = [f for f in self.functions.values() if f.kernel.ptr == ptr]
        sig = kernel_signatures(fn.source)[fn.name]
        assert len(params) == len(sig), f"{fn.name}: {len(params)} params for {len(sig)}"
        args = {}
        for p, addr in zip(sig, params):
            code = _DECODE[p.kind, p.size]
            (args[p.name],) = struct.unpack("=" + code, ctypes.string_at(addr, p.size))
        self.launches.append(Launch(fn, (gx, gy, gz, bx, by, bz, smem), args, self._pending.pop()))
        assert extra is None
        return 0


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    real_call = _driver.DriverKernel.__call__

    def call(self, grid, block, *values, shared_mem=0):
        rec._pending.append(values)
        return real_call(self, grid, block, *values, shared_mem=shared_mem)

    monkeypatch.setattr(_driver.DriverKernel, "__call__", call)
    monkeypatch.setattr(_driver, "_driver", lambda: rec.cu_launch_kernel)
    monkeypatch.setattr(_driver, "_driver_ex", lambda: None)
    monkeypatch.setattr(_driver, "_launchers", {})  # stand-ins never reach the real cache
    monkeypatch.setattr(_cuda, "get_function", rec.get_function)
    monkeypatch.setattr(_cuda, "device_index", lambda: 0)
    monkeypatch.setattr(_cuda, "raw_stream", lambda device: 0)
    monkeypatch.setattr(_cuda, "num_sms", lambda device: 132)
    monkeypatch.setattr(_cuda, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    monkeypatch.setattr(wac, "_PLANS", {})
    monkeypatch.setattr(wac, "_CARVED", set())
    monkeypatch.setattr(wp, "_GATHERS", {})
    for module in (wac, wp, fcos3d_mod):
        monkeypatch.setattr(module, "use_kernel", lambda *a, **k: True)
    return rec


def _check_launches(rec: Recorder) -> None:
    """Every launch: argument types against the kernel's, values read back as packed."""
    assert rec.launches and not rec._pending
    for launch in rec.launches:
        fn = launch.fn
        sig = kernel_signatures(fn.source)[fn.name]
        key = (fn.source, fn.name, fn.options, 0)
        assert_argtypes_match(fn.name, _driver._launchers[key]._argtypes, sig)
        for p, value in zip(sig, launch.values):
            got = launch.args[p.name]
            if p.kind == "float" and p.size == 4:
                value = struct.unpack("f", struct.pack("f", value))[0]
            assert got == value, f"{fn.name}: {p.name} reads back {got}, packed {value}"
        smem = launch.dims[6]
        assert smem <= 48 * 1024 or fn.max_dynamic_shared_size_bytes >= smem, fn.name


@pytest.mark.parametrize("kernel", ["mma", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_attention_launches(recorder: Recorder, kernel: str, dtype: torch.dtype) -> None:
    windows, heads, n, d, nw = 4, 3, 49, 32, 2
    q, k, v, dout = (torch.randn(windows, heads, n, d).to(dtype) for _ in range(4))
    k = k.transpose(0, 1).contiguous().transpose(0, 1)  # strides differ from q's
    bias, mask = torch.randn(heads, n, n), torch.zeros(nw, n, n)
    wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.17)
    wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, 1)
    fwd, bwd = recorder.launches
    assert fwd.fn.name.startswith(f"window_attention_{'mma_' if kernel == 'mma' else ''}fwd")
    assert bwd.fn.name.startswith(f"window_attention_{'mma_' if kernel == 'mma' else ''}bwd")
    _check_launches(recorder)
    for launch, scale, backward in ((fwd, 0.17, False), (bwd, 1.0, True)):
        a = launch.args
        assert (a["B_"], a["nH"], a["N"], a["nW"]) == (windows, heads, n, nw)
        assert (a["qb"], a["qh"], a["qn"]) == q.stride()[:3]
        assert (a["kb"], a["kh"], a["kn"]) == k.stride()[:3]
        assert a["q"] == q.data_ptr() and a["k"] == k.data_ptr() and a["v"] == v.data_ptr()
        assert a["bias"] == bias.data_ptr() and a["mask"] == mask.data_ptr()
        assert a["scale"] == pytest.approx(scale, rel=1e-7)
        assert launch.dims[1] == heads and launch.dims[3:6] == (wac._THREADS, 1, 1)
        smem = (
            wac._mma_smem_bytes(d, backward)
            if kernel == "mma"
            else 4 * wac._smem_floats(n, d, backward)
        )
        assert launch.dims[6] == smem
    # backward needs more than the 48 KB a kernel gets without opting in (_check_launches
    # checks the opt-in on the launched function)
    assert bwd.dims[6] > 48 * 1024
    assert bwd.args["dout"] == dout.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_window_partition_and_merge_launches(recorder: Recorder, dtype: torch.dtype) -> None:
    x = torch.randn(2, 14, 21, 8).to(dtype)
    windows = wp._partition_cuda(x, 7, 3)
    wp._merge_cuda(windows, 14, 21, 3)
    _check_launches(recorder)
    part, merge = recorder.launches
    row = 8 * x.element_size()
    for launch, flag in ((part, 0), (merge, 1)):
        a = launch.args
        assert (a["H"], a["W"], a["ws"], a["sh"], a["sw"], a["merge"]) == (14, 21, 7, 3, 3, flag)
        unit = int(launch.fn.name.rsplit("_", 1)[1])
        assert a["units"] == row // unit and a["total"] == x.numel() * x.element_size() // unit
    assert part.args["src"] == x.data_ptr() and part.args["dst"] == windows.data_ptr()


@pytest.mark.parametrize("box_format", ["cxcywh", "xyxy"])
def test_simota_launches(recorder: Recorder, box_format: str) -> None:
    B, G, A, C = 2, 3, 40, 5
    args = (
        torch.rand(B, G, 4) * 50,
        torch.randint(0, C, (B, G)),
        torch.ones(B, G, dtype=torch.bool),
        torch.rand(A, 2) * 64,
        torch.full((A,), 8.0),
        torch.rand(B, A, 4) * 50,
        torch.randn(B, A, C),
        torch.randn(B, A),
    )
    launch_simota(args, (B, G, A, C), 2.5, True, False, box_format)
    _check_launches(recorder)
    names = [launch.fn.name for launch in recorder.launches]
    assert names == ["simota_prepare", "simota_select", "simota_resolve"]
    assert all(launch.fn.options == ("-std=c++17", "--fmad=false") for launch in recorder.launches)
    for launch in recorder.launches:
        a = launch.args
        assert (a["B"], a["G"], a["A"], a["C"], a["radius"]) == (B, G, A, C, 2.5)
        assert (a["center_only"], a["xyxy"]) == (1, int(box_format == "xyxy"))
        assert a.get("penalty", 0) == 0
    prepare, select, resolve = recorder.launches
    assert prepare.dims[:2] == (-(-A // 8), B) and select.dims[:2] == (B * G, 1)
    assert resolve.dims[:2] == (-(-A // 256), B)


def test_fcos3d_launch(recorder: Recorder) -> None:
    B, P, G, code = 2, 30, 3, 9
    points = torch.rand(P, 2) * 64
    strides, ranges = fcos3d_mod.point_meta([P], [8], [(-1, 1e8)])
    gts = (
        torch.rand(B, G, 4) * 64,
        torch.randint(0, 10, (B, G)),
        torch.randn(B, G, code),
        torch.randint(0, 10, (B, G)),
        torch.rand(B, G, 2) * 64,
        torch.rand(B, G) * 50,
        torch.randint(0, 9, (B, G)),
        torch.ones(B, G, dtype=torch.bool),
    )
    # labels beyond int32 and a radius that float32 would round: both must arrive exactly
    out = fcos3d_mod._fcos3d_cuda(points, strides, ranges, *gts, -(2**40), 2**33, 1.1, 2.5)
    _check_launches(recorder)
    (launch,) = recorder.launches
    a = launch.args
    assert (a["P"], a["G"], a["code"]) == (P, G, code)
    assert a["radius"] == 1.1 and a["neg_alpha"] == -2.5
    assert (a["background_label"], a["attr_background_label"]) == (-(2**40), 2**33)
    assert a["points"] == points.data_ptr() and a["attr_out"] == out[5].data_ptr()
    assert launch.dims[:2] == (1, B)


def test_out_of_range_values_raise_at_a_call_site(recorder: Recorder) -> None:
    x = torch.randn(1, 7, 7, 2)
    windows = wp._partition_cuda(x, 7, 0)
    name = recorder.launches[0].fn.name
    tail = (7, 7, 0, 0, _cuda.numpy().int64(1), _cuda.numpy().int64(49), 0)
    # a plain int is an int32 parameter: 2**31 cannot be packed, and the error says which
    with pytest.raises(ValueError, match=rf"{name}: argument 2 \(2147483648\) does not fit"):
        _driver.run_kernel(wac.SOURCE, name, 1, 256, x, windows, 2**31, *tail)
    with pytest.raises(ValueError, match=rf"{name} takes 10 arguments, got 3"):
        _driver.run_kernel(wac.SOURCE, name, 1, 256, x, windows, 7)
    assert len(recorder.launches) == 1
