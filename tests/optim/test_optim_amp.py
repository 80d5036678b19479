"""aiak.optim with GradScaler (unscale and skip on the device) and amp copy-back."""

from __future__ import annotations

import pytest
import torch
from _optim_helpers import (
    HALF,
    SHAPES,
    clones,
    exact,
    make_params,
)

from aiak.optim import LAMB, LARS, FusedAdamW, FusedSGD

# --------------------------------------------------------------------------------------------
# GradScaler, amp copy-back
# --------------------------------------------------------------------------------------------


def _scaled_step(opt, params, scaler, grads) -> None:
    scale = scaler.scale(torch.ones(()))  # also creates the scale on the first call
    for p, g in zip(params, grads):
        p.grad = (g * scale).to(p.dtype)
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscales_and_skips_like_torch() -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    ours, ref = FusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, foreach=True)
    sa, sb = (torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2))
    g = torch.Generator().manual_seed(1)
    for t in range(6):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        if t == 2:
            grads[3][0, 0] = float("inf")
            before = [p.detach().clone() for p in a]
            state = {k: v.clone() for k, v in ours.state[a[3]].items()}
        _scaled_step(ours, a, sa, grads)
        _scaled_step(ref, b, sb, grads)
        if t == 2:  # skipped: params, moments and step count untouched
            exact([p.detach() for p in a], before)
            for k, v in state.items():
                torch.testing.assert_close(ours.state[a[3]][k], v, rtol=0, atol=0)
    exact(a, b)
    assert float(ours.state[a[0]]["step"]) == 5.0
    assert sa.get_scale() == sb.get_scale() == 128.0


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdamW(p, lr=1e-2),
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: LAMB(p, lr=1e-2, weight_decay=0.01),
        lambda p: LARS(p, lr=0.1),
    ],
)
def test_grad_scaler_skip_leaves_everything_unchanged(make) -> None:
    ps = clones(make_params(SHAPES, torch.float32))
    opt = make(ps)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    _scaled_step(opt, ps, scaler, [torch.randn(p.shape) for p in ps])
    saved = [p.detach().clone() for p in ps]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    grads = [torch.randn(p.shape) for p in ps]
    grads[0][0] = float("nan")
    _scaled_step(opt, ps, scaler, grads)
    exact([p.detach() for p in ps], saved)
    for p, s in zip(ps, states):
        for k, v in s.items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("model_dtype", HALF)
@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdamW(p, lr=1e-2),
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: LAMB(p, lr=1e-2, weight_decay=0.01),
        lambda p: LARS(p, lr=0.1),
    ],
)
def test_amp_copy_back_writes_model_params(model_dtype, make) -> None:
    masters = clones(make_params(SHAPES, torch.float32))
    models = [m.detach().to(model_dtype) for m in masters]
    opt = make(masters)
    assert opt._aiak_supports_copy_back
    # One param without a model copy: it is updated, nothing else is written for it.
    opt._aiak_copy_back = {m: d for m, d in zip(masters[1:], models[1:])}
    stale = models[0].clone()
    for _ in range(3):
        for m in masters:
            m.grad = torch.randn(m.shape)
        opt.step()
    for m, d in zip(masters[1:], models[1:]):
        torch.testing.assert_close(d, m.detach().to(model_dtype), rtol=0, atol=0)
    torch.testing.assert_close(models[0], stale, rtol=0, atol=0)
