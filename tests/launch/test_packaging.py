"""The wheel ships aiak-auto.pth at site-packages' root and aiakrun's start-up folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_the_start_up_hook(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {out.stderr[-500:]}")
    (wheel,) = tmp_path.glob("aiak-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        pth = z.read("aiak-auto.pth").decode()
    assert "aiak/launch/_site/sitecustomize.py" in names
    assert pth == (ROOT / "launch" / "aiak-auto.pth").read_text()
    assert pth.startswith("import os;") and "AIAK_AUTO" in pth and pth.count("\n") == 1


def test_pth_line_does_nothing_without_auto():
    line = (ROOT / "launch" / "aiak-auto.pth").read_text()
    code = f"import sys\nexec({line!r})\nassert 'aiak.launch._boot' not in sys.modules\n"
    code += "import os\nos.environ['AIAK_AUTO'] = '1'\n" + f"exec({line!r})\n"
    code += "assert any(type(f).__name__ == 'AfterTorch' for f in sys.meta_path)\n"
    code += "assert 'torch' not in sys.modules\n"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
