"""aiak.optim on CPU against torch and float64 references: k-step parity (bit for bit where
the op order is torch's) for Adam/AdamW/SGD, LAMB/LARS against float64, hypothesis over
shapes and hyper-parameters."""

from __future__ import annotations

import itertools

import pytest
import torch
from _optim_helpers import (
    HALF,
    SHAPES,
    K,
    clones,
    exact,
    groups,
    lamb_reference,
    lars_reference,
    lockstep,
    make_params,
    rel_l2,
    within_ulp,
)
from hypothesis import given
from hypothesis import strategies as st

from aiak.optim import LAMB, LARS, FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

# --------------------------------------------------------------------------------------------
# Adam / AdamW / SGD against torch
# --------------------------------------------------------------------------------------------

ADAM_OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.1]))


@pytest.mark.parametrize(("adam_w", "amsgrad", "maximize", "wd"), ADAM_OPTIONS)
def test_adam_fp32_matches_torch_foreach_bit_for_bit(adam_w, amsgrad, maximize, wd) -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": wd, "amsgrad": amsgrad, "maximize": maximize}
    ours = FusedAdam(groups(a, lr=3e-3, weight_decay=wd / 2), adam_w_mode=adam_w, **kw)
    twin = torch.optim.AdamW if adam_w else torch.optim.Adam
    ref = twin(groups(b, lr=3e-3, weight_decay=wd / 2), foreach=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    exact(a, b)
    for p, q in zip(a, b):
        for key in ref.state[q]:
            torch.testing.assert_close(ours.state[p][key].cpu(), ref.state[q][key], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("adam_w", "amsgrad"), [(True, False), (False, True)])
def test_adam_half_matches_torch_fused(dtype, adam_w, amsgrad) -> None:
    # fp16/bf16: fp32 arithmetic, params and state stored in the param dtype, as torch's fused.
    ps = make_params(SHAPES, dtype)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": amsgrad}
    ours = FusedAdamW(a, **kw) if adam_w else FusedAdam(a, adam_w_mode=False, **kw)
    ref = (torch.optim.AdamW if adam_w else torch.optim.Adam)(b, fused=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    within_ulp(a, b)
    assert all(ours.state[p]["exp_avg"].dtype == dtype for p in a)


SGD_OPTIONS = [
    (0.0, 0.0, False, 0.0, False),
    (0.9, 0.0, False, 0.1, False),
    (0.9, 0.1, False, 0.0, True),
    (0.9, 0.0, True, 0.1, False),
    (0.5, 0.0, True, 0.0, True),
]


@pytest.mark.parametrize(("momentum", "dampening", "nesterov", "wd", "maximize"), SGD_OPTIONS)
def test_sgd_matches_torch_foreach_bit_for_bit(momentum, dampening, nesterov, wd, maximize):
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": wd,
        "maximize": maximize,
    }
    ours = FusedSGD(groups(a, lr=0.05), lr=0.1, **kw)
    ref = torch.optim.SGD(groups(b, lr=0.05), lr=0.1, foreach=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    exact(a, b)
    if momentum:
        for p, q in zip(a, b):
            torch.testing.assert_close(
                ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"], rtol=0, atol=0
            )


def test_params_without_grad_are_skipped() -> None:
    ps = clones(make_params([(4,), (5,)], torch.float32))
    before = ps[1].detach().clone()
    opt = FusedAdamW(ps, lr=0.1)
    ps[0].grad = torch.ones(4)
    opt.step()
    assert ps[1] not in opt.state
    torch.testing.assert_close(ps[1].detach(), before, rtol=0, atol=0)
    assert float(opt.state[ps[0]]["step"]) == 1.0


def test_zero_grad_follows_set_grad_none() -> None:
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert p.grad is not None and not p.grad.any()
    FusedAdam([p]).zero_grad()
    assert p.grad is None


# --------------------------------------------------------------------------------------------
# LAMB / LARS against float64 references
# --------------------------------------------------------------------------------------------

LAMB_OPTIONS = [
    # adam_w_mode, grad_averaging, bias_correction, use_nvlamb, weight_decay, max_grad_norm
    (True, True, True, False, 0.01, 1.0),
    (True, True, True, False, 0.0, 1.0),  # wd 0 and not nvlamb: no trust ratio
    (True, True, True, True, 0.0, 1.0),
    (False, True, True, False, 0.01, 1.0),
    (True, False, False, False, 0.01, 1.0),
    (True, True, True, False, 0.01, 0.0),  # no clipping
    (True, True, True, False, 0.01, 1e4),  # norm below the bound: no clipping either
]


def _grad_fn(params: list[torch.Tensor], scale: float, seed: int):
    cache: dict[int, list[torch.Tensor]] = {}

    def grads(t: int) -> list[torch.Tensor]:
        if t not in cache:
            g = torch.Generator().manual_seed(seed + t)
            cache[t] = [torch.randn(p.shape, generator=g) * scale for p in params]
        return cache[t]

    return grads


def _drive(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads, steps: int) -> None:
    for t in range(1, steps + 1):
        for p, g in zip(params, grads(t)):
            p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize(("adam_w", "averaging", "bias", "nvlamb", "wd", "max_norm"), LAMB_OPTIONS)
def test_lamb_matches_float64_reference(adam_w, averaging, bias, nvlamb, wd, max_norm) -> None:
    ps = make_params(SHAPES, torch.float32)
    grads = _grad_fn(ps, 3.0, 7)  # global norm ~ 80 > max_grad_norm=1: clipping is exercised
    opts = {
        "lr": 1e-2,
        "betas": (0.9, 0.99),
        "eps": 1e-6,
        "weight_decay": wd,
        "bias_correction": bias,
        "grad_averaging": averaging,
        "adam_w_mode": adam_w,
        "max_grad_norm": max_norm,
        "use_nvlamb": nvlamb,
    }
    a = clones(ps)
    opt = FusedLAMB(groups(a), **opts)
    _drive(opt, a, grads, K)
    ref = lamb_reference(ps, grads, K, **opts)
    assert rel_l2(a, ref) <= 1e-5
    assert rel_l2([x - p for x, p in zip(a, ps)], [r - p for r, p in zip(ref, ps)]) <= 1e-4


def test_lamb_seed_defaults() -> None:
    p = torch.zeros(2, requires_grad=True)
    d = LAMB([p]).defaults
    assert (d["lr"], d["weight_decay"], d["betas"], d["eps"]) == (1e-3, 0.0, (0.9, 0.999), 1e-8)
    assert d["adam_w_mode"] and d["grad_averaging"] and d["max_grad_norm"] == 1.0
    f = FusedLAMB([p]).defaults
    assert (f["eps"], f["weight_decay"], f["use_nvlamb"]) == (1e-6, 0.01, False)


@pytest.mark.parametrize(("exclude_1d", "wd", "momentum"), [(True, 1e-4, 0.9), (False, 0.0, 0.5)])
def test_lars_matches_float64_reference(exclude_1d, wd, momentum) -> None:
    ps = make_params(SHAPES, torch.float32)
    grads = _grad_fn(ps, 1.0, 11)
    opts = {
        "lr": 0.5,
        "momentum": momentum,
        "weight_decay": wd,
        "trust_coefficient": 0.02,
        "eps": 1e-8,
        "exclude_1d": exclude_1d,
    }
    a = clones(ps)
    opt = LARS(groups(a), **opts)
    _drive(opt, a, grads, K)
    ref = lars_reference(ps, grads, K, **opts)
    assert rel_l2(a, ref) <= 1e-5
    assert rel_l2([x - p for x, p in zip(a, ps)], [r - p for r, p in zip(ref, ps)]) <= 1e-4


# --------------------------------------------------------------------------------------------
# Hypothesis: shapes and hyper-parameters
# --------------------------------------------------------------------------------------------

shapes_st = st.lists(
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
)


@given(
    shapes=shapes_st,
    lr=st.floats(1e-4, 0.1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.floats(1e-10, 1e-3),
    wd=st.floats(0.0, 0.5),
    amsgrad=st.booleans(),
)
def test_hypothesis_adamw_is_torch_adamw(shapes, lr, b1, b2, eps, wd, amsgrad) -> None:
    ps = make_params(shapes, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": wd, "amsgrad": amsgrad}
    lockstep([(FusedAdamW(a, **kw), a), (torch.optim.AdamW(b, foreach=True, **kw), b)], 3)
    exact(a, b)


@given(
    shapes=shapes_st,
    lr=st.floats(1e-4, 0.1),
    wd=st.floats(0.0, 0.1),
    max_norm=st.sampled_from([0.0, 0.5, 100.0]),
    nvlamb=st.booleans(),
)
def test_hypothesis_lamb_is_reference(shapes, lr, wd, max_norm, nvlamb) -> None:
    ps = make_params(shapes, torch.float32)
    grads = _grad_fn(ps, 1.0, 0)
    opts = {
        "lr": lr,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": wd,
        "max_grad_norm": max_norm,
        "use_nvlamb": nvlamb,
    }
    a = clones(ps)
    _drive(FusedLAMB(a, **opts), a, grads, 3)
    assert rel_l2(a, lamb_reference(ps, grads, 3, **opts)) <= 1e-5
