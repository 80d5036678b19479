"""aiak::fused_lamb_: the fused optimizer cases of ``_fused_cases`` (opcheck, GradScaler skip,
torch.compile, the CUDA kernel against the reference) run on LAMB."""

from __future__ import annotations

import pytest
import torch
from _fused_args import lamb as make_args
from _fused_cases import *  # noqa: F403  (the shared tests, collected here with ``fused``)
from _fused_cases import Fused

import aiak.ops

OP = aiak.ops.fused_lamb_


@pytest.fixture
def fused() -> Fused:
    return Fused(OP, make_args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_global_norm_in_parts_is_their_root_sum_of_squares(device: str) -> None:
    """One part per device: the op combines them as sqrt(sum of squares), as one norm (on
    CUDA one part on the CPU, one on the GPU, as a multi-device LAMB passes them)."""
    whole = make_args(device, grad_norms=[torch.tensor(5.0, device=device)])
    parts = make_args(device, grad_norms=[torch.tensor(3.0), torch.tensor(4.0, device=device)])
    OP(*whole)
    OP(*parts)
    for a, b in zip(whole.params, parts.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert make_args().max_grad_norm < 5.0  # clipping is exercised


@pytest.mark.parametrize(
    ("norms", "exc", "match"),
    [
        ([], ValueError, "grad_norms must be a non-empty list"),
        (torch.tensor(1.0), TypeError, "grad_norms"),
        ([torch.ones(2)], ValueError, r"grad_norms\[0\] must have one element"),
        ([torch.ones((), dtype=torch.float64)], TypeError, r"grad_norms\[0\] must be"),
    ],
)
def test_bad_grad_norms_are_named(norms, exc, match) -> None:
    with pytest.raises(exc, match=match):
        OP(*make_args(grad_norms=norms))
