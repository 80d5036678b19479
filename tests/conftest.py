"""Shared test set-up: seeding, markers, hypothesis profiles.

Never query the GPU at import time of a test module (collection must work without one);
``cuda``-marked tests are skipped in ``pytest_runtest_setup`` with the reason.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None:
        reason = _cuda_skip_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture
def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
