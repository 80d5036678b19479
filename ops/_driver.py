"""The one way aiak launches a kernel: ``cuLaunchKernelEx`` through ctypes (``cuLaunchKernel``
where the driver lacks it).

``DriverKernel`` is a CuPy-compiled kernel with its parameter types, its arguments packed by
one ``struct.pack_into``; ``run_kernel`` launches by source and name, the parameter types read
from the values of its first call. Where libcuda cannot be loaded, or the kernel has no driver
handle, ``DriverKernel`` hands the same grid, block, shared memory and arguments to CuPy's own
launch. Compilation, streams and the device stay in ``ops/_cuda.py``.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from functools import cache
from typing import Any

import torch

from aiak.ops import _cuda

_CUDA_ERROR_INVALID_CONTEXT = 201
_U32 = 1 << 32  # cuLaunchKernel's dimensions and shared memory are unsigned 32-bit


@cache
def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@cache
def _driver() -> Any:
    """libcuda's cuLaunchKernel through ctypes, or None where the library cannot be loaded."""
    lib = _libcuda()
    if lib is None:
        return None
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return fn


# cuLaunchKernelEx's CUlaunchConfig (cuda.h): seven unsigned launch numbers, the stream, the
# attribute array and its length (56 bytes with C's tail padding); CUlaunchAttribute: the id,
# 4 bytes of padding, a 64-byte value.
# tests/ops/test_launch_layer.py checks both layouts against cuda.h where it is installed.
LAUNCH_CONFIG = struct.Struct("@7IQQI4x")
LAUNCH_ATTRIBUTE = struct.Struct("@i4xi60x")
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# the one attribute a dependent launch passes (read-only, shared by every thread's config)
_DEPENDENT = ctypes.create_string_buffer(LAUNCH_ATTRIBUTE.size)
LAUNCH_ATTRIBUTE.pack_into(_DEPENDENT, 0, _PROGRAMMATIC_STREAM_SERIALIZATION, 1)
_DEPENDENT_ADDRESS = ctypes.addressof(_DEPENDENT)
_programmatic = True


@cache
def _driver_ex() -> Any:
    """libcuda's cuLaunchKernelEx (CUDA 12+), or None."""
    fn = getattr(_libcuda(), "cuLaunchKernelEx", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4
    return fn


@cache
def _dependent_launch_ok(device: int) -> bool:
    """Programmatic dependent launch needs sm_90 or later (griddepcontrol)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def programmatic_launches(enabled: bool) -> bool:
    """Turn programmatic dependent launches (``DriverKernel(after_previous=True)``) on or off
    for the whole process; returns the previous setting. Off, those kernels launch plainly and
    compute the same: their waits then return at once. For comparisons and as an escape hatch."""
    global _programmatic
    previous, _programmatic = _programmatic, bool(enabled)
    return previous


def _numpy_type(ctype: Any) -> Any:
    """The numpy scalar type CuPy passes as the ctypes type ``ctype``."""
    np = _cuda.numpy()
    size = ctypes.sizeof(ctype)
    if ctype in (ctypes.c_float, ctypes.c_double):
        return np.float32 if size == 4 else np.float64
    signed = ctype(-1).value == -1
    return {(4, True): np.int32, (8, True): np.int64, (4, False): np.uint32}.get(
        (size, signed), np.uint64
    )


def _dim3(what: str, value: Any) -> tuple[int, int, int]:
    dims = value if type(value) is tuple else (value,)
    if not 1 <= len(dims) <= 3 or not all(type(d) is int for d in dims):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if not all(0 < d < _U32 for d in dims):
        raise ValueError(f"{what} dimensions must be in [1, 2**32), got {value!r}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


def _dims(grid: Any, block: Any, shared_mem: Any) -> tuple[int, ...]:
    """cuLaunchKernel's seven launch numbers, checked: ctypes would wrap an out-of-range value
    of a ``c_uint`` parameter silently."""
    if type(shared_mem) is not int or not 0 <= shared_mem < _U32:
        raise ValueError(f"shared_mem must be an int in [0, 2**32), got {shared_mem!r}")
    return (*_dim3("grid", grid), *_dim3("block", block), shared_mem)


class DriverKernel:
    """A CuPy-compiled kernel launched with ``cuLaunchKernelEx`` through ctypes: the arguments
    and the launch config are packed by ``struct.pack_into`` into buffers kept per thread, whose
    parameter pointer array is built once.

    On the H100 machine's host a CuPy launch costs 9.2 µs plus 0.6 µs per numpy scalar
    argument; this costs 7.9 µs with four arguments through ``cuLaunchKernelEx``, against 10.4
    through ``cuLaunchKernel`` (its eleven ctypes arguments) and 8.4 for ``torch.mul`` in the
    same run.
    ``after_previous=True`` makes every launch a programmatic dependent launch on sm_90 and
    later (cuLaunchKernelEx): the kernel may start while the one before it on the stream still
    runs, so it must call ``grid_dep_wait()`` (kernels/mta_common.cuh) before it touches memory
    an earlier kernel writes or reads. A chain of such launches after one plain launch hides
    most of the launch gap between its kernels; elsewhere they launch plainly.
    ``argtypes`` are ctypes types matching the kernel's parameters (``c_uint64`` for pointers);
    an int that does not fit its type raises ``ValueError`` instead of wrapping (a float beyond
    float32's range packs as +-inf, C's conversion). Where libcuda
    cannot be loaded, or the kernel has no driver handle, CuPy launches it with the same grid,
    block, shared memory and argument types. A function attribute set through CuPy (such as
    ``max_dynamic_shared_size_bytes``) is set on the same ``CUfunction`` handle, so it holds
    for these launches too.
    """

    __slots__ = (
        "_after",
        "_argtypes",
        "_codes",
        "_cupy_fn",
        "_local",
        "_offsets",
        "_pack",
        "_ptr",
        "_size",
    )

    def __init__(self, fn: Any, argtypes: tuple[Any, ...], after_previous: bool = False) -> None:
        self._cupy_fn = fn
        self._argtypes = argtypes
        self._after = bool(after_previous)
        handle = getattr(getattr(fn, "kernel", None), "ptr", None)
        self._ptr = handle if _driver() is not None else None
        self._local = threading.local()
        # native mode: C's sizes and alignment, so field i sits where the kernel expects it
        self._codes = codes = "".join(t._type_ for t in argtypes)
        layout = struct.Struct("@" + codes)
        self._pack, self._size = layout.pack_into, layout.size
        self._offsets = tuple(
            struct.calcsize("@" + codes[: i + 1]) - struct.calcsize(c) for i, c in enumerate(codes)
        )

    def __call__(self, grid: Any, block: Any, *values: Any, shared_mem: int = 0) -> None:
        """Launch on torch's current stream; ``values`` in the order of ``argtypes``. ``grid``
        and ``block``: an int or an (x, y[, z]) tuple; ``shared_mem``: dynamic shared memory
        bytes per block."""
        if type(grid) is int and type(block) is int and 0 < grid < _U32 and 0 < block < _U32:
            dims = (grid, 1, 1, block, 1, 1, shared_mem)
            if shared_mem:
                dims = _dims(grid, block, shared_mem)
        else:
            dims = _dims(grid, block, shared_mem)
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = self._new_slots()
        buf, params, config = slots
        try:
            self._pack(buf, 0, *values)
        except (struct.error, OverflowError) as exc:
            raise self._bad_values(values) from exc
        if self._ptr is None:
            args = tuple(_numpy_type(t)(v) for t, v in zip(self._argtypes, values))
            stream = _cuda.current_stream()
            self._cupy_fn(dims[:3], dims[3:6], args, shared_mem=dims[6], stream=stream)
            return
        device = _cuda.device_index()
        stream = _cuda.raw_stream(device)
        ex = _driver_ex()
        if ex is not None:
            # one packed config and four pointer arguments: 2.5 us less host time a launch than
            # cuLaunchKernel's eleven ctypes arguments (H100 machine: 7.9 against 10.4 us)
            dependent = self._after and _programmatic and _dependent_launch_ok(device)
            LAUNCH_CONFIG.pack_into(config, 0, *dims, stream, _DEPENDENT_ADDRESS, dependent)
            err = ex(config, self._ptr, params, None)
        else:
            err = _driver()(self._ptr, *dims, stream, params, None)
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            # a thread that has made no CUDA runtime call yet has no current context: binding
            # the device through torch makes the primary context (CuPy's and torch's) current
            torch.cuda.set_device(device)
            if ex is not None:
                err = ex(config, self._ptr, params, None)
            else:
                err = _driver()(self._ptr, *dims, stream, params, None)
        if err:
            raise RuntimeError(f"aiak: kernel launch failed with CUDA error {err}")

    def _bad_values(self, values: tuple) -> ValueError:
        name = getattr(self._cupy_fn, "name", None) or "kernel"
        if len(values) != len(self._codes):
            return ValueError(f"{name} takes {len(self._codes)} arguments, got {len(values)}")
        for i, (code, value) in enumerate(zip(self._codes, values)):
            try:
                struct.pack("@" + code, value)
            except (struct.error, OverflowError) as exc:
                ctype = self._argtypes[i].__name__
                return ValueError(f"{name}: argument {i} ({value!r}) does not fit {ctype}: {exc}")
        return ValueError(f"{name}: arguments {values!r} do not pack as {self._codes}")

    def _new_slots(self) -> tuple[Any, Any, Any]:
        buf = ctypes.create_string_buffer(max(self._size, 1))
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
        return buf, params, ctypes.create_string_buffer(LAUNCH_CONFIG.size)


def run_kernel(
    source: str,
    name: str,
    grid: int | tuple[int, ...],
    block: int | tuple[int, ...],
    *values: object,
    options: tuple[str, ...] = _cuda.DEFAULT_OPTIONS,
    shared_mem: int = 0,
) -> None:
    """Launch kernel ``name`` of ``kernels/<source>`` (compiled with ``options``) on torch's
    current stream through a :class:`DriverKernel`.

    A value's type gives its parameter type (:func:`argtype`): a tensor or None passes as its
    address, an int as int32, a float as float32, and a numpy scalar as its own type
    (``np.int64``, ``np.float64``, ...). The kernel and its argument layout are made on the
    first call per (source, name, options, device), from the types of that call's values: every
    call site of a kernel passes the same types (floats through ``float(...)``), which
    tests/ops/test_launch_args.py checks against the kernels' signatures.
    """
    key = (source, name, options, _cuda.device_index())
    kernel = _launchers.get(key)
    if kernel is None:
        argtypes = tuple(map(argtype, values))
        fn = _cuda.get_function(source, name, options)
        kernel = _launchers[key] = DriverKernel(fn, argtypes)
    kernel(
        grid,
        block,
        *[_address(v) if type(v) in _TENSORS or v is None else v for v in values],
        shared_mem=shared_mem,
    )


def argtype(value: object) -> Any:
    """The ctypes parameter type :func:`run_kernel` passes ``value`` as."""
    if value is None or isinstance(value, torch.Tensor):
        return ctypes.c_uint64
    kind = type(value)
    if kind is int or kind is bool:
        return ctypes.c_int32
    if kind is float:
        return ctypes.c_float
    found = _numpy_argtypes().get(kind)
    if found is None:
        raise TypeError(
            f"a kernel argument must be a tensor, None, an int, a float or a numpy scalar of "
            f"{sorted(t.__name__ for t in _numpy_argtypes())}, got {kind.__name__}"
        )
    return found


@cache
def _numpy_argtypes() -> dict[type, Any]:
    np = _cuda.numpy()
    return {
        np.int32: ctypes.c_int32,
        np.int64: ctypes.c_int64,
        np.uint32: ctypes.c_uint32,
        np.uint64: ctypes.c_uint64,
        np.float32: ctypes.c_float,
        np.float64: ctypes.c_double,
    }


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_TENSORS = (torch.Tensor, torch.nn.Parameter)
# One DriverKernel per (source, name, options, device): bounded by the kernels of ops/kernels,
# the option sets the ops compile with, and the devices.
_launchers: dict[tuple[str, str, tuple[str, ...], int], DriverKernel] = {}
