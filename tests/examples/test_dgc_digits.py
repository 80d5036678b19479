"""examples/dgc_digits.py: DGC at 0.001 within a point of dense SGD with >= 300x fewer bytes;
downsampling n=4 within a point with 4x fewer bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
PATH = Path(__file__).resolve().parents[2] / "examples" / "dgc_digits.py"


def test_dgc_matches_dense_accuracy_with_300x_fewer_bytes() -> None:
    spec = importlib.util.spec_from_file_location("dgc_digits", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.launch(epochs=20, seeds=[0], limit=280)["0"]
    dense, dgc, ds = r["dense"], r["dgc"], r["downsample"]
    assert dense["accuracy"] > 95
    assert dgc["accuracy"] >= dense["accuracy"] - 1.0
    assert dense["bytes"] / dgc["bytes"] >= 300
    assert dense["bytes"] / ds["bytes"] == pytest.approx(4, rel=0.01)
    # 97.78 vs 98.06 at seed 0 with gradient momentum 0.9; seeds 0-5 are all within 0.28
    # points below dense or above it (docs/dgc.md)
    assert ds["accuracy"] >= dense["accuracy"] - 1.0
