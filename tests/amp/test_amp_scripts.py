"""The benchmark's CPU smoke mode and the example run, and say what they measured."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(relative: str) -> ModuleType:
    name = "_amp_script_" + Path(relative).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_amp_cpu_smoke(tmp_path: Path) -> None:
    bench = _load("benchmarks/bench_amp.py")
    out = tmp_path / "amp.csv"
    rows = bench.main(["--device", "cpu", "--steps", "3", "--csv", str(out)])
    with out.open() as f:
        written = list(csv.DictReader(f))
    assert [r["mode"] for r in written] == [r["mode"] for r in rows]
    assert {"fp32", "o1", "o2"} <= {r["mode"] for r in written}
    o2 = next(r for r in written if r["mode"] == "o2")
    assert float(o2["median_ms"]) > 0 and float(o2["images_per_s"]) > 0
    assert float(o2["o2_added_ms"]) > 0 and o2["note"].startswith("backend=")
    assert float(o2["loss_gap_vs_o1"]) < 0.05


@pytest.mark.slow
def test_example_trains() -> None:
    example = _load("examples/amp_o2.py")
    ratio = example.main(["--steps", "24", "--batch", "16", "--width", "8", "--batches", "2"])
    assert ratio < 0.8, f"the example's loss fell only to {ratio:.2f} of its start"
    import torch

    assert not hasattr(torch.cuda.amp, "aiak_amp_decorate"), "the example uninstalls"
