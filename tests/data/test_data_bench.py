"""benchmarks/bench_data.py part (b) runs on the CPU in a reduced size and checks that every
loader variant yields the same batches in the same order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_data.py"


@pytest.mark.slow
def test_bench_part_b_runs_on_cpu() -> None:
    args = ["--part", "b", "--device", "cpu", "--samples", "128", "--epochs", "2"]
    args += ["--workers", "1", "--rounds", "1", "--sample-us", "10", "--no-csv"]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "same batch order: True" in out.stdout
    for variant in ("standard", "persistent", "aiak"):
        assert f"\n{variant.rjust(10)} " in out.stdout
