"""benchmarks/bench_dgc_hook.py --quick runs on the CPU (gloo, world 1) and reports its three
rows; the per-bucket hook makes fewer aten ops per step than the per-tensor one (a count, not a
timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_runs_and_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_dgc_hook.py"), "--quick"]
    argv += ["--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "PERSEUS_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["allreduce", "dgc per-tensor", "dgc per-bucket"]
    for r in rows.values():
        assert r["host_ms"] > 0 and r["step_ms"] > 0 and r["aten_ops"] > 0
        assert r["cuda_launches"] is None  # CPU: no profiler columns
    assert rows["dgc per-bucket"]["aten_ops"] < rows["dgc per-tensor"]["aten_ops"]
    assert "per-tensor / per-bucket" in proc.stdout
