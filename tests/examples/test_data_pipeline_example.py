"""examples/data_pipeline.py: the aiak.data pipeline trains exactly like the bare DataLoader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data_pipeline.py"


def test_pipeline_trains_like_the_plain_loader() -> None:
    spec = importlib.util.spec_from_file_location("data_pipeline_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ref = module.train("cpu", epochs=3, samples=512, workers=1, plain=True)
    ours = module.train("cpu", epochs=3, samples=512, workers=1)
    assert ours == ref  # same batches in the same order: the same training, bit for bit
    assert ref < 0.6  # it learned something (chance is ln 2)
