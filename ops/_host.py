"""The host path's per-tensor reads: :func:`layout_key` and :func:`any_requires_grad`.

A multi-tensor op on a stable tensor set asks, per call, whether this is the set it validated
and uploaded before: every tensor's address, size, dtype and contiguity. From Python each of
those is a pass of attribute calls over the list; ``_host.cpp`` reads all of them in one C++
loop (161 tensors: ~1.6 µs against 8-15 µs a pass; benchmarks/bench_multi_tensor_l2norm.py
prints both paths).

``_host.cpp`` is compiled with the system C++ compiler on the first CUDA call that needs it
(about 16 s, once: the library is kept under ``$AIAK_CACHE_DIR``, default ``~/.cache/aiak``,
keyed by the source, torch and Python). Without a compiler or Python's headers, or with
``AIAK_NATIVE_HOST=0``, the same functions run in Python: same answers, more host time. Both
paths answer the same questions; the tests compare them.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import operator
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows: no lock; the rename alone keeps a library whole
    fcntl = None  # type: ignore[assignment]

_SOURCE = Path(__file__).with_name("_host.cpp")
_BUILD_TIMEOUT_S = 600  # a 2-core machine compiles it in ~30 s
_lock = threading.Lock()
_loaded: list[Any] = []  # [module or None]: the path in use, decided on first use
_built: list[Any] = []  # [module] once it has loaded


def layout_key(lists: Sequence[Sequence[torch.Tensor]]) -> bytes | tuple | None:
    """A value equal for two calls exactly when every list has the same length and the same
    tensors by address, numel, dtype and device, all contiguous; None when a tensor is not
    contiguous or an item is not a strided tensor (then nothing is cached for the set)."""
    mod = native()
    if mod is not None:
        return mod.layout_key(lists)
    return _layout_key_py(lists)


def any_requires_grad(args: tuple) -> bool:
    """Whether any tensor argument, or tensor of a list or tuple argument, requires grad.
    Compiled once :func:`layout_key` has loaded the helper (a CUDA call); it never builds it,
    so CPU-only use never waits for a compiler."""
    mod = _loaded[0] if _loaded else None
    if mod is not None:
        return mod.any_requires_grad(args)
    return _any_requires_grad_py(args)


_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_requires_grad = operator.attrgetter("requires_grad")


def _layout_key_py(lists: Sequence[Sequence[torch.Tensor]]) -> tuple | None:
    try:
        if not all(all(map(_is_contiguous, ts)) for ts in lists):
            return None
        return parts(lists)
    except (TypeError, AttributeError, RuntimeError):  # not tensors; sparse (no address)
        return None


def parts(lists: Sequence[Sequence[torch.Tensor]]) -> tuple[tuple, tuple, tuple]:
    """Per list, the tensors' numels, addresses and dtypes (what a device table is built from;
    the Python key). Unbound methods through map: the cheapest per-tensor calls Python has."""
    return (
        tuple(tuple(map(_numel, ts)) for ts in lists),
        tuple(tuple(map(_data_ptr, ts)) for ts in lists),
        tuple(tuple(map(_dtype, ts)) for ts in lists),
    )


def _any_requires_grad_py(args: tuple) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)):
            try:
                if any(map(_requires_grad, a)):
                    return True
            except AttributeError:  # not all tensors: the op's checks name the culprit
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in a):
                    return True
    return False


def native() -> Any:
    """The compiled helper module, or None (the Python path): decided once per process."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def status() -> str:
    """``"native"``, ``"python: <reason>"`` (for ``aiak.ops.backends()``); builds if needed."""
    return "native" if native() is not None else "python: " + _why[0]


_why = ["not tried"]


def _load() -> Any:
    if os.environ.get("AIAK_NATIVE_HOST", "1") == "0":
        _why[0] = "AIAK_NATIVE_HOST=0"
        return None
    try:
        module = _import(_build())
        _built[:] = [module]
        return module
    except Exception as e:  # no compiler, no headers, a read-only cache: the Python path
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
        _why[0] = "build failed: " + reason
        warnings.warn(
            f"aiak: the C++ host helper (ops/_host.cpp) did not build ({reason}); the Python "
            "host path runs instead: the same results, more host time per multi-tensor call",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _library_path() -> Path:
    tag = hashlib.sha256()
    tag.update(_SOURCE.read_bytes())
    tag.update(f"{torch.__version__} {sys.version} {sys.platform}".encode())
    root = Path(os.environ.get("AIAK_CACHE_DIR") or Path.home() / ".cache" / "aiak")
    return root / "host" / f"aiak_host-{tag.hexdigest()[:16]}.so"


def _build() -> Path:
    """The library of this source, torch and Python, compiled unless it exists. Processes that
    get here at once (the ranks of one job) take turns on a lock file: one compiles, the
    others find its library. It is written under a temporary name and renamed, so a library
    is never seen half-written (also where the lock cannot be taken)."""
    lib = _library_path()
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:  # waits at most one build: the compiler runs under a timeout
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            _compile(lib)
    return lib


def _compile(lib: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")
    py_include = sysconfig.get_paths()["include"]
    if not Path(py_include, "Python.h").exists():
        raise RuntimeError(f"Python.h not found in {py_include} (the python3-dev package)")
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    libdirs = cpp_extension.library_paths()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp, lib.name)
        cmd = [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in (*cpp_extension.include_paths(), py_include)),
            str(_SOURCE), "-o", str(out),
            *(f"-L{p}" for p in libdirs), *(f"-Wl,-rpath,{p}" for p in libdirs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr[-2000:]}")
        os.replace(out, lib)


def _import(path: Path) -> Any:
    loader = importlib.machinery.ExtensionFileLoader("aiak_host", str(path))
    spec = importlib.util.spec_from_file_location("aiak_host", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def use_native(on: bool) -> None:
    """Switch between the compiled helper and the Python path for the rest of the process
    (benchmarks compare the two in one run; tests run both). Tables cached under one path's
    keys are not found by the other: they are rebuilt once."""
    with _lock:
        _loaded.clear()
        if not on:
            _why[0] = "switched off (use_native(False))"
        _loaded.append((_built[0] if _built else _load()) if on else None)
