"""aiak::fused_lamb_: the fused optimizer cases of ``_fused_cases`` (opcheck, GradScaler skip,
torch.compile, the CUDA kernel against the reference) run on LAMB."""

from __future__ import annotations

import pytest
from _fused_args import lamb as make_args
from _fused_cases import *  # noqa: F403  (the shared tests, collected here with ``fused``)
from _fused_cases import Fused

import aiak.ops

OP = aiak.ops.fused_lamb_


@pytest.fixture
def fused() -> Fused:
    return Fused(OP, make_args)
