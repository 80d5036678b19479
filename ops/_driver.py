"""The one way aiak launches a kernel: :class:`Kernel`, through ``cuLaunchKernelEx``.

Each kernel's parameters are declared once, next to its source's name in the op's module::

    _ADAM = Kernel("fused_adam.cu", "fused_adam", "ptr table, i32 T, ptr lr_ptr, f32 lr")

with the types ``ptr`` (a tensor, None for a null pointer, or an address), ``i32``, ``i64``,
``u32``, ``u64``, ``f32`` and ``f64``. When the kernel is first loaded, the declaration is
checked against the ``extern "C" __global__`` signature of ``ops/kernels/<source>`` (types and
names, kernels written by macros included): a kernel parameter read as the wrong type gives no
error on the GPU, only wrong numbers, so a mismatch raises ``TypeError`` before any launch.

A launch packs its values with one ``struct.pack_into`` into a per-thread buffer whose
parameter pointer array is built once, and hands ``cuLaunchKernelEx`` one packed launch config
on torch's current stream (four pointer arguments through ctypes: a launch costs the host
about what a torch op's does). Compilation, streams and the device stay in ``ops/_cuda.py``.
"""

from __future__ import annotations

import ctypes
import re
import struct
import sys
import threading
from functools import cache
from typing import Any

import torch

from aiak.ops import _cuda

_CUDA_ERROR_INVALID_CONTEXT = 201
_U32 = 1 << 32  # launch dimensions and shared memory are unsigned 32-bit
# declared type -> struct code (native sizes and alignment: the kernel's parameter layout)
CODES = {"ptr": "Q", "i32": "i", "i64": "q", "u32": "I", "u64": "Q", "f32": "f", "f64": "d"}

# cuLaunchKernelEx's CUlaunchConfig (cuda.h): seven unsigned launch numbers, the stream, the
# attribute array and its length (56 bytes with C's tail padding); CUlaunchAttribute: the id,
# 4 bytes of padding, a 64-byte value. tests/ops/test_launch_layer.py checks both against cuda.h.
LAUNCH_CONFIG = struct.Struct("@7IQQI4x")
LAUNCH_ATTRIBUTE = struct.Struct("@i4xi60x")
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# the one attribute a dependent launch passes (read-only, shared by every thread's config)
_DEPENDENT = ctypes.create_string_buffer(LAUNCH_ATTRIBUTE.size)
LAUNCH_ATTRIBUTE.pack_into(_DEPENDENT, 0, _PROGRAMMATIC_STREAM_SERIALIZATION, 1)
_DEPENDENT_ADDRESS = ctypes.addressof(_DEPENDENT)
_programmatic = True
_ex: Any = None  # libcuda's cuLaunchKernelEx, opened by the first kernel load


def _open_launch() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"aiak: libcuda.so.1 cannot be loaded: {exc}") from exc
    fn = getattr(lib, "cuLaunchKernelEx", None)
    if fn is None:
        raise RuntimeError("aiak: the CUDA driver has no cuLaunchKernelEx (CUDA 12+ needed)")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4
    return fn


@cache
def _dependent_launch_ok(device: int) -> bool:
    """Programmatic dependent launch needs sm_90 or later (griddepcontrol)."""
    return _cuda.device_capability(device)[0] >= 9


def programmatic_launches(enabled: bool) -> bool:
    """Turn programmatic dependent launches (``Kernel(after_previous=True)``) on or off for the
    whole process; returns the previous setting. Off, those kernels launch plainly and compute
    the same: their waits then return at once. For comparisons and as an escape hatch."""
    global _programmatic
    previous, _programmatic = _programmatic, bool(enabled)
    return previous


def _dim3(what: str, value: Any) -> tuple[int, int, int]:
    dims = value if type(value) is tuple else (value,)
    if not 1 <= len(dims) <= 3 or not all(type(d) is int for d in dims):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if not all(0 < d < _U32 for d in dims):
        raise ValueError(f"{what} dimensions must be in [1, 2**32), got {value!r}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


# Checked launch numbers of tuple grids (a plan's grids repeat every call): checking them again
# costs a launch about 13 µs of host time on the lent machines' hosts.
_DIMS: dict[tuple, tuple[int, ...]] = {}
_DIMS_KEEP = 4096


def _dims(grid: Any, block: Any, shared_mem: Any) -> tuple[int, ...]:
    """The seven launch numbers, checked: packed as unsigned 32-bit, an out-of-range value
    would wrap silently."""
    if type(shared_mem) is not int or not 0 <= shared_mem < _U32:
        raise ValueError(f"shared_mem must be an int in [0, 2**32), got {shared_mem!r}")
    return (*_dim3("grid", grid), *_dim3("block", block), shared_mem)


def parse_params(text: str) -> tuple[tuple[str, str], ...]:
    """``"ptr x, i64 n"`` -> ``(("ptr", "x"), ("i64", "n"))``."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        words = item.split()
        if len(words) != 2 or words[0] not in CODES:
            raise ValueError(f"a kernel parameter is '<{'|'.join(CODES)}> <name>', got {item!r}")
        out.append((words[0], words[1]))
    return tuple(out)


class Kernel:
    """Kernel ``name`` of ``ops/kernels/<source>`` compiled with ``options``, its parameters
    declared by ``params`` (see the module docstring); call it as
    ``kernel(grid, block, *values, shared_mem=0)`` to launch on torch's current stream.

    ``grid`` and ``block``: an int or an (x, y[, z]) tuple. A value that does not fit its type
    raises ``ValueError`` naming the parameter instead of wrapping (a float beyond float32's
    range packs as +-inf, C's conversion). ``after_previous=True`` makes every launch on sm_90
    and later a programmatic dependent launch: the kernel may start while the one before it on
    the stream still runs, so it calls ``grid_dep_wait()`` (kernels/mta_common.cuh) before it
    touches memory an earlier kernel writes or reads.
    """

    __slots__ = (
        "_after",
        "_checked",
        "_handles",
        "_local",
        "_n",
        "_offsets",
        "_pack",
        "_ptrs",
        "_size",
        "name",
        "options",
        "owner",
        "params",
        "source",
    )

    def __init__(
        self,
        source: str,
        name: str,
        params: str,
        *,
        options: tuple[str, ...] = _cuda.DEFAULT_OPTIONS,
        after_previous: bool = False,
    ) -> None:
        self.source, self.name, self.options = source, name, tuple(options)
        self.params = parse_params(params)
        self._after = bool(after_previous)
        codes = "".join(CODES[t] for t, _ in self.params)
        layout = struct.Struct("@" + codes)
        self._pack, self._size, self._n = layout.pack_into, layout.size, len(codes)
        self._offsets = tuple(
            struct.calcsize("@" + codes[: i + 1]) - struct.calcsize(c) for i, c in enumerate(codes)
        )
        self._ptrs = tuple(i for i, (t, _) in enumerate(self.params) if t == "ptr")
        self._handles: dict[int, int] = {}
        self._checked = False
        self._local = threading.local()
        self.owner = sys._getframe(1).f_globals.get("__name__", "")  # the declaring module
        DECLARED.append(self)

    def function(self) -> Any:
        """The CuPy function on the current device, compiled on first use and its declaration
        checked against the source: function attributes (``max_dynamic_shared_size_bytes``)
        set on it hold for this launcher's launches (the same ``CUfunction``)."""
        if not self._checked:
            check_signature(self)
            self._checked = True
        return _cuda.get_function(self.source, self.name, self.options)

    def __call__(self, grid: Any, block: Any, *values: Any, shared_mem: int = 0) -> None:
        if (
            type(grid) is int
            and type(block) is int
            and 0 < grid < _U32
            and 0 < block < _U32
            and not shared_mem
        ):
            dims = (grid, 1, 1, block, 1, 1, 0)
        else:
            try:
                dims = _DIMS[grid, block, shared_mem]
            except (KeyError, TypeError):  # not seen yet, or a list (unhashable): check it
                dims = _dims(grid, block, shared_mem)
                if len(_DIMS) < _DIMS_KEEP and type(grid) is tuple:
                    _DIMS[grid, block, shared_mem] = dims
        device = _cuda.device_index()
        handle = self._handles.get(device)
        if handle is None:
            handle = self._load(device)
        if len(values) != self._n:
            raise ValueError(f"{self.name} takes {self._n} arguments, got {len(values)}")
        if self._ptrs:
            values = list(values)  # type: ignore[assignment]
            for i in self._ptrs:
                v = values[i]
                if v is None:
                    values[i] = 0  # type: ignore[index]
                elif type(v) is not int:
                    values[i] = v.data_ptr()  # type: ignore[index]
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = self._new_slots()
        buf, params, config = slots
        try:
            self._pack(buf, 0, *values)
        except (struct.error, OverflowError) as exc:
            raise self._bad_values(values) from exc
        dependent = self._after and _programmatic and _dependent_launch_ok(device)
        stream = _cuda.raw_stream(device)
        LAUNCH_CONFIG.pack_into(config, 0, *dims, stream, _DEPENDENT_ADDRESS, dependent)
        err = _ex(config, handle, params, None)
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            # a thread that has made no CUDA runtime call yet has no current context: binding
            # the device through torch makes the primary context (CuPy's and torch's) current
            torch.cuda.set_device(device)
            err = _ex(config, handle, params, None)
        if err:
            raise RuntimeError(f"aiak: launch of {self.name} failed with CUDA error {err}")

    def _load(self, device: int) -> int:
        global _ex
        handle = self._handles[device] = self.function().kernel.ptr
        if _ex is None:
            _ex = _open_launch()
        return handle

    def _bad_values(self, values: Any) -> ValueError:
        for (kind, name), value in zip(self.params, values):
            try:
                struct.pack("@" + CODES[kind], value)
            except (struct.error, OverflowError) as exc:
                return ValueError(f"{self.name}: {name} ({value!r}) does not fit {kind}: {exc}")
        return ValueError(f"{self.name}: arguments {values!r} do not pack as {self.params}")

    def _new_slots(self) -> tuple[Any, Any, Any]:
        buf = ctypes.create_string_buffer(max(self._size, 1))
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
        return buf, params, ctypes.create_string_buffer(LAUNCH_CONFIG.size)


DECLARED: list[Kernel] = []  # every Kernel made, for tests/ops/test_launch_layer.py


# --------------------------------------------------------------------------------------------
# The kernels' signatures, read from the CUDA sources
# --------------------------------------------------------------------------------------------

_GLOBAL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?(\w+)\s*\(([^)]*)\)'
)
_MACRO = re.compile(r"^[ \t]*#define[ \t]+(\w+)\(([^)]*)\)(.*)$", re.MULTILINE)
_TYPEDEF = re.compile(r"\btypedef\s+([\w ]+?)\s+(\w+)\s*;")
_C_TYPES = {
    "int": "i32",
    "long long": "i64",
    "unsigned int": "u32",
    "unsigned": "u32",
    "unsigned long long": "u64",
    "float": "f32",
    "double": "f64",
}


def _c_param(text: str, typedefs: dict[str, str]) -> tuple[str, str]:
    words = re.findall(r"\w+|\*", text)
    if "*" in words:
        return "ptr", words[-1]
    base = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "volatile"))
    base = typedefs.get(base, base)
    if base not in _C_TYPES:
        raise TypeError(f"unknown kernel parameter type {base!r} in {text!r}")
    return _C_TYPES[base], words[-1]


def signatures(source: str) -> dict[str, tuple[tuple[str, str], ...]]:
    """``{kernel: ((type, name), ...)}`` of every ``extern "C" __global__`` kernel of the CUDA
    source text ``source``, those written by function-like macros included."""
    text = source.replace("\\\n", " ")  # splice lines, then drop comments, as C does
    text = re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", text), flags=re.DOTALL)
    typedefs = {alias: base for base, alias in _TYPEDEF.findall(text)}
    expanded = []
    for name, formals, body in _MACRO.findall(text):
        if "__global__" not in body:
            continue
        names = [p.strip() for p in formals.split(",")]
        for actuals in re.findall(rf"^[ \t]*{name}\(([^)]*)\)", text, re.MULTILINE):
            values = dict(zip(names, (a.strip() for a in actuals.split(","))))
            expanded.append(re.sub(r"\w+", lambda m, v=values: v.get(m[0], m[0]), body))
    out = {}
    for name, params in _GLOBAL.findall(_MACRO.sub("", text) + "\n".join(expanded)):
        out[name] = tuple(_c_param(p, typedefs) for p in params.split(",") if p.strip())
    return out


@cache
def source_signatures(filename: str) -> dict[str, tuple[tuple[str, str], ...]]:
    return signatures(_cuda.kernel_source(filename))


def check_signature(kernel: Kernel) -> None:
    """Raise ``TypeError`` unless ``kernel``'s declaration is its source's signature."""
    found = source_signatures(kernel.source).get(kernel.name)
    if found is None:
        raise TypeError(f'{kernel.source} has no extern "C" __global__ kernel {kernel.name}')
    if found != kernel.params:

        def show(params: tuple) -> str:
            return ", ".join(f"{t} {n}" for t, n in params)

        raise TypeError(
            f"{kernel.name}: declared ({show(kernel.params)}) but {kernel.source} has "
            f"({show(found)})"
        )
