"""benchmarks/_harness.py: CSV rows keep every column when a benchmark gains one."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("_bench_harness", ROOT / "benchmarks/_harness.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_bench_harness", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setattr(module, "environment", lambda: {"gpu": "x"})
    return module


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_append_csv_appends_and_widens_the_header(harness) -> None:
    path = harness.append_csv("t", [{"mode": "a", "ms": 1.0}])
    harness.append_csv("t", [{"mode": "b", "ms": 2.0}])
    fields, rows = _read(path)
    assert fields == ["gpu", "mode", "ms"] and [r["mode"] for r in rows] == ["a", "b"]
    # A new column: the file is rewritten with it, old rows keep their values.
    harness.append_csv("t", [{"mode": "c", "ms": 3.0, "spread": 0.5}])
    fields, rows = _read(path)
    assert fields == ["gpu", "mode", "ms", "spread"]
    assert [(r["mode"], r["ms"], r["spread"]) for r in rows] == [
        ("a", "1.0", ""),
        ("b", "2.0", ""),
        ("c", "3.0", "0.5"),
    ]
    # Fewer columns than the file has: appended under the file's header.
    harness.append_csv("t", [{"mode": "d", "ms": 4.0}])
    fields, rows = _read(path)
    assert fields == ["gpu", "mode", "ms", "spread"] and rows[-1]["spread"] == ""
