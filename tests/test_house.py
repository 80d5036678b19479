"""The house's rules (docs/architecture.md), checked: lean imports, independence of subpackages,
modules of a readable size, CUDA sources compile."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every top-level folder with an __init__.py is a subpackage (aiak.<folder>), present or future.
SUBPACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()))
# the op kernels, and research's own (research/kernels: lower bounds for profiling)
KERNELS = sorted((ROOT / "ops" / "kernels").glob("*.cu")) + sorted(
    (ROOT / "research" / "kernels").glob("*.cu")
)


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


def _sibling_imports(pkg: str) -> list[str]:
    """Imports of another aiak subpackage than aiak.ops (the foundation every one may import)."""
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "aiak" and len(parts) > 1 and parts[1] not in (pkg, "ops"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return bad


# What each subpackage may import of its siblings. Default: only ``aiak.ops``, the foundation.
# "lazy": nothing of TRAINING at module level (a launcher imports what it starts only when it
# starts it). "all": the conformance suite.
TRAINING = ("optim", "amp", "comm", "data")
RULES = {"conformance": "all", "launch": "lazy"}


def _module_level_imports(pkg: str, banned: tuple[str, ...]) -> list[str]:
    """Imports of ``aiak.<banned>`` outside any function body."""
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        in_functions = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in in_functions:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "aiak" and len(parts) > 1 and parts[1] in banned:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return bad


def test_every_subpackage_is_found() -> None:
    # The rules below run over what the folder holds; a lost subpackage would go unchecked.
    assert {"ops", "comm", "amp", "optim", "data", "conformance"} <= set(SUBPACKAGES)


@pytest.mark.parametrize("pkg", [p for p in SUBPACKAGES if RULES.get(p) != "all"])
def test_subpackages_do_not_import_siblings(pkg: str) -> None:
    # docs/architecture.md, rule 1: optim, amp, comm and data may import aiak.ops (the
    # foundation), never each other; launch imports none of them at module level.
    if RULES.get(pkg) == "lazy":
        assert _module_level_imports(pkg, TRAINING) == []
    else:
        assert _sibling_imports(pkg) == []


# Modules a reader can hold in mind: no module over MAX_LINES lines in these subpackages.
MAX_LINES = 400
SIZED = ("comm", "amp", "optim", "ops")
# path -> why it may be longer for now. Each entry must still be over the limit (else remove it).
LONG_MODULES: dict[str, str] = {}


def test_modules_stay_small() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for pkg in SIZED
        if (ROOT / pkg).is_dir()
        for path in (ROOT / pkg).rglob("*.py")
    }
    too_long = {p: n for p, n in sizes.items() if n > MAX_LINES and p not in LONG_MODULES}
    assert too_long == {}, f"modules over {MAX_LINES} lines: split them by concern"
    stale = [p for p in LONG_MODULES if sizes.get(p, 0) <= MAX_LINES]
    assert stale == [], f"no longer over {MAX_LINES} lines (or gone): drop from LONG_MODULES"


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

    own = source.parent == ROOT / "ops" / "kernels"
    text = _cuda.kernel_source(source.name) if own else source.read_text()
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
