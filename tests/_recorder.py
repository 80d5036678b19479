"""The launcher with ``cuLaunchKernelEx`` recorded instead of called: every launch's grid,
stream, launch attribute and parameters (read back with the types and names of the kernel's
source), on the CPU."""

from __future__ import annotations

import ctypes
import struct
import types

import pytest

from aiak.ops import _cuda, _driver


def _read_back(params: tuple, addresses: object) -> dict[str, object]:
    """Every parameter of a recorded launch, read at the address the driver would read."""
    out = {}
    for i, (kind, name) in enumerate(params):
        code = "@" + _driver.CODES[kind]
        (out[name],) = struct.unpack(code, ctypes.string_at(addresses[i], struct.calcsize(code)))
    return out


class _Function:
    """Stands in for a CuPy RawKernel: a driver handle and the attributes launchers set."""

    def __init__(self, handle: int) -> None:
        self.kernel = types.SimpleNamespace(ptr=handle)
        self.num_regs = 96
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.preferred_shared_memory_carveout = -1


class Recorder:
    """cuLaunchKernelEx and get_function stand-ins: launches are recorded, nothing runs. Each
    launch's parameters are read back with the types and names of the kernel's source."""

    def __init__(self) -> None:
        self.launches: list[dict] = []
        self.functions: dict[tuple, types.SimpleNamespace] = {}
        self.names: dict[int, tuple[str, str]] = {}

    def get_function(self, source, name, options=_cuda.DEFAULT_OPTIONS):
        key = (source, name, options)
        if key not in self.functions:
            handle = 0x1000 + len(self.functions)
            self.names[handle] = (source, name)
            self.functions[key] = _Function(handle)
        return self.functions[key]

    def ex(self, config, handle, params, extra) -> int:
        *dims, stream, attrs, nattrs = _driver.LAUNCH_CONFIG.unpack_from(config)
        attr = _driver.LAUNCH_ATTRIBUTE.unpack(ctypes.string_at(attrs, 8 + 64)) if nattrs else ()
        source, name = self.names.get(handle, (None, None))
        args = None
        if source is not None:
            args = _read_back(_driver.source_signatures(source)[name], params)
        launch = {"name": name, "dims": tuple(dims), "stream": stream, "attr": attr, "args": args}
        self.launches.append(launch)
        assert extra is None
        return 0


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(_driver, "_ex", rec.ex)
    monkeypatch.setattr(_cuda, "get_function", rec.get_function)
    monkeypatch.setattr(_cuda, "device_index", lambda: 0)
    monkeypatch.setattr(_cuda, "raw_stream", lambda device: 77)
    monkeypatch.setattr(_cuda, "num_sms", lambda device: 132)
    monkeypatch.setattr(_cuda, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(_driver, "_dependent_launch_ok", lambda device: True)
    for k in _driver.DECLARED:  # the stand-in handles never reach a real launch
        monkeypatch.setattr(k, "_handles", {})
    return rec
