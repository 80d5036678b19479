"""Kernel compilation and the CUDA context around a launch: CuPy RawModule and stream
caches, the current device, kernel sources and their ``#define``s.

Everything here is lazy: importing this module imports no cupy and does not initialise CUDA.
Kernels are CUDA C++ files in ``ops/kernels/`` compiled at run time by NVRTC through CuPy (no
build step at install). They launch through ``ops/_driver.py`` only, on torch's current stream,
so they order correctly with torch's own kernels and are captured by CUDA graphs like them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import threading
from functools import cache
from pathlib import Path
from typing import Any

import torch

KERNEL_DIR = Path(__file__).parent / "kernels"

# -std=c++17 for `if constexpr`; --use_fast_math is NOT used: it changes sqrt/division rounding,
# which the conformance tolerances would notice on fp32. Note that CuPy appends -ftz=true after
# these options whatever they say (cupy/cupy#9576): fp32 arithmetic in our kernels flushes
# subnormal results to zero unless written as explicit PTX without .ftz (cast_scale.cu does).
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17",)

_lock = threading.Lock()
_modules: dict[tuple[str, tuple[str, ...], int], Any] = {}
_functions: dict[tuple[str, str, tuple[str, ...], int], Any] = {}


def kernels_disabled() -> bool:
    """``AIAK_DISABLE_KERNELS=1`` makes every op run its PyTorch reference (for debugging).

    Read on every kernel call, so it can be switched at any time; straight from the environ's
    own mapping where the platform has one (``os.environ.get`` costs several Python frames).
    """
    value = _environ_get(_ENV_KEY, _ENV_DEFAULT)
    if value == _ENV_DEFAULT:
        return False
    value = os.environ.get("AIAK_DISABLE_KERNELS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"AIAK_DISABLE_KERNELS must be 0 or 1, got {value!r}")
    return value == "1"


_environ_data = getattr(os.environ, "_data", None)
if isinstance(_environ_data, dict) and hasattr(os.environ, "encodekey"):
    _environ_get = _environ_data.get
    _ENV_KEY = os.environ.encodekey("AIAK_DISABLE_KERNELS")
    _ENV_DEFAULT = os.environ.encodevalue("0")
else:  # pragma: no cover - platforms without CPython's environ mapping
    _environ_get = os.environ.get
    _ENV_KEY, _ENV_DEFAULT = "AIAK_DISABLE_KERNELS", "0"


@cache
def cupy_unavailable_reason() -> str | None:
    """Why CuPy cannot launch kernels here, or None when it can. Imports cupy on first call."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'aiak[cuda12]' or 'aiak[cuda13]')"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # a broken install (wrong CUDA major) fails here
        return f"cupy failed to import: {type(exc).__name__}: {exc}"
    return None


def cupy():
    """The cupy module (imported on first use)."""
    reason = cupy_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import cupy as cp

    return cp


_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([\w.]+)"\s*$', re.MULTILINE)


@cache
def kernel_source(filename: str) -> str:
    """The text of ``ops/kernels/<filename>`` with its local ``#include "x.cuh"`` inlined.

    Inlining (instead of ``-I``) makes CuPy's compile cache, keyed by the source text, see a
    change in a shared header.
    """
    path = KERNEL_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:  # every header is `#pragma once`
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text().replace("#pragma once\n", "")
        return _LOCAL_INCLUDE.sub(inline, text)

    return _LOCAL_INCLUDE.sub(inline, path.read_text())


_DEFINE = re.compile(r"^#define\s+([A-Z_][A-Z0-9_]*)\s+(\d+)\b", re.MULTILINE)


@cache
def defines(filename: str) -> dict[str, int]:
    """The integer ``#define NAME value`` lines of ``ops/kernels/<filename>``: constants the
    host shares with a kernel (flag bits, block and chunk sizes) are written once, in the CUDA
    source, and read from there."""
    return {k: int(v) for k, v in _DEFINE.findall((KERNEL_DIR / filename).read_text())}


def _device_index_slow() -> int:
    return torch.cuda.current_device()


# torch.cuda.current_device() re-runs its lazy-init and fork checks on every call (~2 µs);
# once CUDA is initialised, which every caller here has done by holding a CUDA tensor, the C
# call alone gives the same value.
device_index = getattr(torch._C, "_cuda_getDevice", _device_index_slow)


def get_function(filename: str, name: str, options: tuple[str, ...] = DEFAULT_OPTIONS) -> Any:
    """The compiled kernel ``name`` of ``ops/kernels/<filename>`` for the current torch device.

    Modules are cached by (source, options, device); compilation happens once per process and
    device (CuPy also keeps a disk cache, so later processes skip NVRTC).
    """
    device = device_index()
    key = (filename, name, options, device)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    cp = cupy()
    with _lock:
        mkey = (filename, options, device)
        module = _modules.get(mkey)
        if module is None:
            with cp.cuda.Device(device):
                module = cp.RawModule(code=kernel_source(filename), options=options)
            _modules[mkey] = module
        with cp.cuda.Device(device):
            fn = module.get_function(name)
        _functions[key] = fn
    return fn


def _raw_stream_slow(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# torch's current stream on a device as a pointer, without building a Stream object.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream_slow)


@cache
def device_properties(device: int) -> Any:
    return torch.cuda.get_device_properties(device)


@cache
def device_capability(device: int) -> tuple[int, int]:
    """(major, minor), cached: torch.cuda.get_device_capability re-reads the properties."""
    return torch.cuda.get_device_capability(device)


def on_device(device: torch.device) -> Any:
    """``torch.cuda.device(device)``, or a no-op when it is already current (the usual case:
    switching costs two cudaSetDevice calls per op)."""
    if device.index is None or device.index == device_index():
        return SAME_DEVICE
    return torch.cuda.device(device)


SAME_DEVICE = contextlib.nullcontext()  # reusable


def num_sms(device: int) -> int:
    return device_properties(device).multi_processor_count
