"""The convergence claim on real data (examples/lamb_digits.py): LAMB at batch 1024 reaches
AdamW-at-batch-32's test accuracy within a point on sklearn's digits. Skipped without sklearn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn is not installed (the test extra has it)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lamb_digits.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lamb_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lamb_digits"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_lamb_large_batch_matches_adamw_small_batch(example) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add noise and time
    try:
        adamw = example.train("adamw", 32, 60, seed=0)
        lamb = example.train("lamb", 1024, 150, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert adamw > 95.0  # the baseline learned the task
    assert lamb >= adamw - 1.0, (lamb, adamw)
