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


@pytest.mark.parametrize("pkg", ["ops", "comm", "amp", "optim", "data"])
def test_subpackages_do_not_import_siblings(pkg: str) -> None:
    # Independence on one foundation: a subpackage may import aiak.ops, never a sibling.
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
