"""Kernel launches through the CUDA driver API from ctypes, for ops whose cost is mostly the
host path: ``DriverKernel`` (a CuPy-compiled kernel, its arguments packed by one
``struct.pack_into``) and ``run_kernel`` (launch by source and name, arguments by kind).
Compilation, streams and the device stay in ``ops/_cuda.py``.
"""

from __future__ import annotations

import threading
from functools import cache
from typing import Any

import torch

from aiak.ops import _cuda

_CUDA_ERROR_INVALID_CONTEXT = 201


@cache
def _driver() -> Any:
    """libcuda's cuLaunchKernel through ctypes, or None where the library cannot be loaded."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return fn


def _numpy_type(ctype: Any) -> Any:
    """The numpy scalar type CuPy passes as the ctypes type ``ctype``."""
    import ctypes

    np = _cuda.numpy()
    size = ctypes.sizeof(ctype)
    if ctype in (ctypes.c_float, ctypes.c_double):
        return np.float32 if size == 4 else np.float64
    signed = ctype(-1).value == -1
    return {(4, True): np.int32, (8, True): np.int64, (4, False): np.uint32}.get(
        (size, signed), np.uint64
    )


class DriverKernel:
    """A CuPy-compiled kernel launched with ``cuLaunchKernel`` through ctypes: the arguments are
    packed by one ``struct.pack_into`` into a buffer kept per thread, whose parameter pointer
    array is built once.

    On the H100 machine's host a CuPy launch costs 9.2 µs plus 0.6 µs per numpy scalar
    argument; this costs 7.8 µs with four arguments, most of it the driver call itself.
    ``argtypes`` are ctypes types matching the kernel's parameters (``c_uint64`` for pointers);
    a value out of its type's range raises ``struct.error`` instead of wrapping. Where libcuda
    cannot be loaded, or the kernel has no driver handle, CuPy launches it.
    """

    __slots__ = ("_argtypes", "_cupy_fn", "_local", "_offsets", "_pack", "_ptr", "_size")

    def __init__(self, fn: Any, argtypes: tuple[Any, ...]) -> None:
        import struct

        self._cupy_fn = fn
        self._argtypes = argtypes
        handle = getattr(getattr(fn, "kernel", None), "ptr", None)
        self._ptr = handle if _driver() is not None else None
        self._local = threading.local()
        # native mode: C's sizes and alignment, so field i sits where the kernel expects it
        codes = "".join(t._type_ for t in argtypes)
        layout = struct.Struct("@" + codes)
        self._pack, self._size = layout.pack_into, layout.size
        self._offsets = tuple(
            struct.calcsize("@" + codes[: i + 1]) - struct.calcsize(c) for i, c in enumerate(codes)
        )

    def __call__(self, grid: int, block: int, *values: Any) -> None:
        """Launch on torch's current stream; ``values`` in the order of ``argtypes``."""
        if self._ptr is None:
            args = tuple(_numpy_type(t)(v) for t, v in zip(self._argtypes, values))
            self._cupy_fn((grid,), (block,), args, stream=_cuda.current_stream())
            return
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = self._new_slots()
        buf, params = slots
        self._pack(buf, 0, *values)
        stream = _cuda.raw_stream(_cuda.device_index())
        err = _driver()(self._ptr, grid, 1, 1, block, 1, 1, 0, stream, params, None)
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            # a thread that has made no CUDA runtime call yet has no current context: binding
            # the device through torch makes the primary context (CuPy's and torch's) current
            torch.cuda.set_device(_cuda.device_index())
            err = _driver()(self._ptr, grid, 1, 1, block, 1, 1, 0, stream, params, None)
        if err:
            raise RuntimeError(f"aiak: cuLaunchKernel failed with CUDA error {err}")

    def _new_slots(self) -> tuple[Any, Any]:
        import ctypes

        buf = ctypes.create_string_buffer(max(self._size, 1))
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
        return buf, params


def run_kernel(source: str, name: str, grid: int, block: int, *values: object) -> None:
    """Launch kernel ``name`` of ``kernels/<source>`` on torch's current stream through a
    :class:`DriverKernel`: a tensor (or None) passes as its address, an int as
    int32, a float as float32 (the kernels' parameter types). The kernel and its argument
    layout are made on the first call per (kernel, device) from the kinds of ``values``; every
    call site passes the same kinds (floats through ``float(...)``)."""
    key = (source, name, _cuda.device_index())
    kernel = _launchers.get(key)
    if kernel is None:
        kinds = tuple(map(_kind, values))
        kernel = _launchers[key] = DriverKernel(_cuda.get_function(source, name), kinds)
    kernel(grid, block, *[_address(v) if type(v) in _TENSORS or v is None else v for v in values])


def _kind(v: object) -> Any:
    import ctypes

    if v is None or isinstance(v, torch.Tensor):
        return ctypes.c_uint64
    return ctypes.c_int32 if isinstance(v, int) else ctypes.c_float


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_TENSORS = (torch.Tensor, torch.nn.Parameter)
_launchers: dict[tuple[str, str, int], DriverKernel] = {}
