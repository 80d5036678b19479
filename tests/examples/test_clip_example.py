"""examples/clip_grad_multi_tensor.py: multi-tensor clipping trains like clip_grad_norm_."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clip_grad_multi_tensor.py"


def test_multi_tensor_clipping_matches_torch_training() -> None:
    spec = importlib.util.spec_from_file_location("clip_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ref = module.train("torch", "cpu", steps=30)
    ours = module.train("aiak", "cpu", steps=30)
    assert ours == pytest.approx(ref, rel=1e-4)
    assert ref < 0.69  # it learned something (chance is ln 2)
