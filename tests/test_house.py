"""The house's rules, checked: lean imports, independence of subpackages, CUDA sources compile."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("ops", "comm", "amp", "optim", "data", "conformance")
KERNELS = sorted((ROOT / "ops" / "kernels").glob("*.cu"))


def test_importing_every_subpackage_is_lean() -> None:
    # torchao's test_lean_import: importing must not initialise CUDA nor import cupy/numba.
    code = (
        "import sys, torch\n"
        + "".join(f"import aiak.{p}\n" for p in SUBPACKAGES)
        + "heavy = sorted(m for m in ('cupy', 'numba', 'numba_cuda') if m in sys.modules)\n"
        "assert not heavy, f'imported {heavy}'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised at import'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_aiak_is_a_namespace_package() -> None:
    assert not (ROOT / "aiak").exists() and not (ROOT / "__init__.py").exists()
    import aiak

    assert getattr(aiak, "__file__", None) is None


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception"}


def _sibling_imports(pkg: str) -> list[str]:
    """Imports of another aiak subpackage outside a try/except ImportError guard."""
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        guarded: set[int] = set()
        for node in ast.walk(tree):
            body: list[ast.stmt] = []
            if isinstance(node, ast.Try):
                catches = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
                if any(c.split(".")[-1] in _IMPORT_ERRORS for c in catches):
                    body = node.body
            elif isinstance(node, ast.With):  # with contextlib.suppress(ImportError): ...
                for item in node.items:
                    call = item.context_expr
                    if (
                        isinstance(call, ast.Call)
                        and ast.unparse(call.func).endswith("suppress")
                        and any(ast.unparse(a).split(".")[-1] in _IMPORT_ERRORS for a in call.args)
                    ):
                        body = node.body
            guarded |= {id(n) for stmt in body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "aiak" and len(parts) > 1 and parts[1] != pkg:
                    allowed = parts[1] == "ops" and id(node) in guarded
                    if not allowed:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return bad


@pytest.mark.parametrize("pkg", ["ops", "comm", "amp", "optim", "data"])
def test_subpackages_do_not_import_siblings(pkg: str) -> None:
    # Rule 1 of ARCHITECTURE.md: the one allowed form is a guarded `import aiak.ops`.
    assert _sibling_imports(pkg) == []


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("nvcc not found: CUDA sources are not compile-checked on this machine")
    return nvcc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", KERNELS, ids=[k.name for k in KERNELS])
def test_cuda_source_compiles(source: Path, arch: str, tmp_path: Path) -> None:
    """Every kernel file compiles with nvcc as NVRTC will see it (local headers inlined)."""
    from aiak.ops import _cuda

    text = _cuda.kernel_source(source.name)
    assert "#include <" not in text, "NVRTC via CuPy has no CUDA include path: no system headers"
    inlined = tmp_path / source.name
    inlined.write_text(text)
    out = subprocess.run(
        [
            _nvcc(),
            "-std=c++17",
            f"-arch={arch}",
            "-cubin",
            "-Werror",
            "all-warnings",
            "-o",
            str(tmp_path / "k.cubin"),
            str(inlined),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr


def _import_time_aiak_imports(pkg: str) -> list[str]:
    """Imports of another aiak subpackage at module import time (module-level statements)."""
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        stack: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while stack:  # every node run at import: function bodies are not
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            stack.extend(ast.iter_child_nodes(node))
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "aiak" and len(parts) > 1 and parts[1] != pkg:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return bad


def test_launch_imports_no_subpackage_at_import_time() -> None:
    # aiak.launch builds environments and starts torch's launcher; its start-up hook and the
    # doctor import subpackages lazily (inside functions), when a variable asks for them.
    assert _import_time_aiak_imports("launch") == []
    code = (
        "import sys\nimport aiak.launch, aiak.launch._boot, aiak.launch.flags\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('aiak.')"
        " and not m.startswith('aiak.launch'))\nassert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
