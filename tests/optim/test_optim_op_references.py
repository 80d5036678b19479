"""The aiak.ops references (the CUDA kernels' ground truth) against torch's fused CPU kernels."""

from __future__ import annotations

import pytest
import torch
from _optim_helpers import (
    HALF,
    SHAPES,
    K,
    clones,
    lockstep,
    make_params,
    rel_l2,
)

from aiak.optim import FusedAdam, FusedSGD

# --------------------------------------------------------------------------------------------
# The aiak.ops references (the CUDA kernels' ground truth) against torch's fused CPU kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("adam_w", [False, True])
def test_ops_adam_reference_matches_torch_fused(dtype, adam_w) -> None:
    ps = make_params(SHAPES, dtype)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True}
    ours = FusedAdam(a, adam_w_mode=adam_w, **kw)
    ref = (torch.optim.AdamW if adam_w else torch.optim.Adam)(b, fused=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    assert rel_l2(a, b) <= (1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps)


def test_ops_sgd_reference_matches_torch_fused() -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "maximize": True}
    ours, ref = FusedSGD(a, **kw), torch.optim.SGD(b, fused=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    assert rel_l2(a, b) <= 1e-6


def test_ops_adam_without_bias_correction_matches_its_formula() -> None:
    # No torch twin for apex's bias_correction=False: the formula, element by element in fp64.
    ps = make_params(SHAPES, torch.float32)
    a = clones(ps)
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    opt = FusedAdam(a, lr=lr, bias_correction=False, weight_decay=wd)
    x = [p.detach().double().clone() for p in ps]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    g = torch.Generator().manual_seed(5)
    for _ in range(K):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, gr in zip(a, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            x[i] = x[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * gr.double()
            v[i] = b2 * v[i] + (1 - b2) * gr.double() ** 2
            x[i] = x[i] - lr * m[i] / (v[i].sqrt() + eps)
    assert rel_l2(a, x) <= 1e-6
    assert rel_l2(a, ps) > 1e-3  # it did move
