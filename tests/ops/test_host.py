"""ops/_host.py: the compiled per-tensor reads answer exactly as the Python path does."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiak.ops import _host, _mta

_NO_TOOLS = (shutil.which("c++") is None and shutil.which("g++") is None) or not Path(
    sysconfig.get_paths()["include"], "Python.h"
).exists()
needs_compiler = pytest.mark.skipif(_NO_TOOLS, reason="no C++ compiler or no Python.h here")


@pytest.fixture(scope="module")
def native():
    mod = _host.native()
    if mod is None:
        pytest.skip(f"the helper did not load: {_host.status()}")
    return mod


@needs_compiler
def test_the_helper_builds_where_a_compiler_is() -> None:
    assert _host.native() is not None, _host.status()
    assert _host.status() == "native"


_POOL = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.zeros(5, dtype=torch.float16),
    torch.ones(2, 3, dtype=torch.bfloat16),
    torch.zeros(0),
    torch.randn(7, dtype=torch.float64),
]
_BASE = torch.arange(24, dtype=torch.float32)


def _variant(i: int) -> object:
    """Tensors and non-tensors that differ from each other in one property at a time."""
    table = [
        *_POOL,
        _POOL[0].t(),  # same address and numel, not contiguous
        _POOL[0].view(torch.int32),  # same address and numel, another dtype
        _POOL[0].view(12),  # same address, dtype and numel: the same layout as [0]
        _BASE[:12],  # a contiguous view at the start of another buffer
        _BASE[:6],  # same address, fewer elements
        _BASE[2:8],  # another address
        _BASE[::2],  # strided
        torch.nn.Parameter(torch.ones(3)),
        3,
        None,
        torch.ones(3).to_sparse(),
    ]
    return table[i % len(table)]


_lists = st.lists(st.lists(st.integers(0, 15), max_size=4), max_size=3)


@given(a=_lists, b=_lists, as_tuple=st.booleans())
def test_layout_keys_agree_with_the_python_path(native, a, b, as_tuple) -> None:
    def build(spec):
        lists = [[_variant(i) for i in ts] for ts in spec]
        return tuple(tuple(ts) for ts in lists) if as_tuple else lists

    la, lb = build(a), build(b)
    ka, kb = native.layout_key(la), native.layout_key(lb)
    pa, pb = _host._layout_key_py(la), _host._layout_key_py(lb)
    assert (ka is None) == (pa is None)
    assert (kb is None) == (pb is None)
    if ka is not None and kb is not None:
        assert (ka == kb) == (pa == pb)


def test_layout_key_sees_list_boundaries_and_every_property(native) -> None:
    x, y, z = torch.ones(2), torch.ones(3), torch.ones(4)
    assert native.layout_key([[x, y], [z]]) != native.layout_key([[x], [y, z]])
    assert native.layout_key([[x]]) == native.layout_key(([x],))
    assert native.layout_key([[x]]) != native.layout_key([[x.view(torch.int32)]])
    assert native.layout_key([[x]]) != native.layout_key([[torch.ones(2)]])
    w = torch.ones(4, 4)
    assert native.layout_key([[w.t()]]) is None
    assert native.layout_key([[x, "x"]]) is None
    assert native.layout_key([x]) is None  # a list of tensors, not of lists
    assert native.layout_key(x) is None


@given(spec=st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=5))
def test_any_requires_grad_agrees_with_the_python_path(native, spec) -> None:
    def arg(kind: int, grad: bool) -> object:
        t = torch.ones(2, requires_grad=grad)
        return (
            [t, torch.ones(1)]
            if kind == 0
            else (torch.ones(1), t)
            if kind == 1
            else (t if kind == 2 else [t, 1.5] if kind == 3 else 2.0)
        )

    args = tuple(arg(kind, grad) for kind, grad in spec)
    assert native.any_requires_grad(args) == _host._any_requires_grad_py(args)


def test_a_failed_build_warns_once_and_the_python_path_answers(monkeypatch) -> None:
    def fail():
        raise RuntimeError("c++ exited with 1: no compiler today")

    monkeypatch.setattr(_host, "_build", fail)
    monkeypatch.setattr(_host, "_built", [])  # as in a process that has not built it yet
    try:
        with pytest.warns(RuntimeWarning, match="did not build.*no compiler today"):
            _host.use_native(True)
        assert _host.native() is None
        assert _host.status().startswith("python: build failed")
        x = torch.ones(3)
        assert _host.layout_key([[x]]) == _host._layout_key_py([[x]])
        assert _host.any_requires_grad((torch.ones(1, requires_grad=True),))
    finally:
        monkeypatch.undo()
        _host._loaded.clear()


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("AIAK_NATIVE_HOST", "0")
    monkeypatch.setattr(_host, "_built", [])
    try:
        _host.use_native(True)
        assert _host.native() is None and _host.status() == "python: AIAK_NATIVE_HOST=0"
    finally:
        monkeypatch.undo()
        _host._loaded.clear()


@needs_compiler
def test_a_built_library_is_reused_not_rebuilt(monkeypatch, native) -> None:
    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert _host._build() == _host._library_path()


def test_library_path_follows_the_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AIAK_CACHE_DIR", str(tmp_path))
    assert _host._library_path().parent == tmp_path / "host"


@pytest.mark.parametrize("native_on", [True, False])
def test_the_table_cache_works_on_either_path(monkeypatch, native_on) -> None:
    if native_on and _host.native() is None:
        pytest.skip(_host.status())
    built = []

    def fake_build(lists, device):
        built.append(lists)
        return _mta.Table(torch.zeros(1, dtype=torch.int64), len(lists), len(lists[0]), 0, None, 0)

    monkeypatch.setattr(_mta, "build", fake_build)
    monkeypatch.setattr(_mta.Table, "wait", lambda self: None)
    _mta.clear_cache()
    _host.use_native(native_on)
    try:
        xs = [torch.ones(3), torch.ones(4)]
        cpu = torch.device("cpu")
        tab = _mta.table([xs], cpu, "t")
        assert _mta.cached("t", [xs]) is tab and _mta.cached("u", [xs]) is None
        assert _mta.cached("t", [xs[:1]]) is None
        strided = [torch.ones(4, 4).t()]
        _mta.table([strided], cpu, "t")
        assert _mta.cached("t", [strided]) is None  # never cached: the key cannot see strides
        assert len(built) == 2 and _mta.cache_info()["tables"] == 1
    finally:
        _mta.clear_cache()
        _host._loaded.clear()


_CHILD = """
from aiak.ops import _host
compile_ = _host._compile
def counted(lib):
    print("compiled", flush=True)
    compile_(lib)
_host._compile = counted
print(_host.status(), flush=True)
"""


@needs_compiler
def test_processes_that_build_at_once_compile_once_and_all_load(tmp_path) -> None:
    """The ranks of one job reach their first CUDA call together: one compiles, the others
    wait on the lock file and load its library; nothing half-written is left behind."""
    import os
    import sys

    env = {**os.environ, "AIAK_CACHE_DIR": str(tmp_path), "AIAK_NATIVE_HOST": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0
            outs.append(out.split())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert sum(o.count("compiled") for o in outs) == 1
    assert all(o[-1] == "native" for o in outs)
    left = sorted(f.suffix for f in (tmp_path / "host").iterdir())
    assert left == [".lock", ".so"]  # no temporary directory remains


def test_an_unusable_cache_dir_falls_back_with_a_warning(monkeypatch, tmp_path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("AIAK_CACHE_DIR", str(not_a_dir))
    monkeypatch.setattr(_host, "_built", [])
    try:
        with pytest.warns(RuntimeWarning, match="did not build"):
            _host.use_native(True)
        assert _host.native() is None and _host.status().startswith("python: build failed")
        x = torch.ones(2)
        assert _host.layout_key([[x]]) == _host._layout_key_py([[x]])
    finally:
        monkeypatch.undo()
        _host._loaded.clear()
