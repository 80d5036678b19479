"""aiak.optim on CPU: k-step parity with torch (bit for bit where the op order is torch's),
LAMB/LARS against float64 references, the aiak.ops references, GradScaler skip, amp copy-back,
state_dict round trips, fuse/from_env/install, input errors, hypothesis."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _optim_helpers import (
    SHAPES,
    clones,
    lamb_reference,
    lars_reference,
    lockstep,
    make_params,
    rel_l2,
)
from hypothesis import given
from hypothesis import strategies as st

import aiak.ops
import aiak.optim
from aiak.optim import LAMB, LARS, FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

K = 10  # steps per parity run
HALF = [torch.float16, torch.bfloat16]


def _groups(params: list[torch.Tensor], **second: float) -> list[dict]:
    """Two param groups, the second with its own hyper-parameters."""
    return [{"params": params[:3]}, {"params": params[3:], **second}]


def _exact(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")


def _within_ulp(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """At most one rounding step apart: same fp32 math, stores rounded once each."""
    for x, y in zip(a, b):
        eps = torch.finfo(x.dtype).eps
        torch.testing.assert_close(x, y, rtol=eps, atol=eps * 1e-3)


# --------------------------------------------------------------------------------------------
# Adam / AdamW / SGD against torch
# --------------------------------------------------------------------------------------------

ADAM_OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.1]))


@pytest.mark.parametrize(("adam_w", "amsgrad", "maximize", "wd"), ADAM_OPTIONS)
def test_adam_fp32_matches_torch_foreach_bit_for_bit(adam_w, amsgrad, maximize, wd) -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": wd, "amsgrad": amsgrad, "maximize": maximize}
    ours = FusedAdam(_groups(a, lr=3e-3, weight_decay=wd / 2), adam_w_mode=adam_w, **kw)
    twin = torch.optim.AdamW if adam_w else torch.optim.Adam
    ref = twin(_groups(b, lr=3e-3, weight_decay=wd / 2), foreach=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    _exact(a, b)
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
    _within_ulp(a, b)
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
    ours = FusedSGD(_groups(a, lr=0.05), lr=0.1, **kw)
    ref = torch.optim.SGD(_groups(b, lr=0.05), lr=0.1, foreach=True, **kw)
    lockstep([(ours, a), (ref, b)], K)
    _exact(a, b)
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
    opt = FusedLAMB(_groups(a), **opts)
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
    opt = LARS(_groups(a), **opts)
    _drive(opt, a, grads, K)
    ref = lars_reference(ps, grads, K, **opts)
    assert rel_l2(a, ref) <= 1e-5
    assert rel_l2([x - p for x, p in zip(a, ps)], [r - p for r, p in zip(ref, ps)]) <= 1e-4


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
            _exact([p.detach() for p in a], before)
            for k, v in state.items():
                torch.testing.assert_close(ours.state[a[3]][k], v, rtol=0, atol=0)
    _exact(a, b)
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
    _exact([p.detach() for p in ps], saved)
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


# --------------------------------------------------------------------------------------------
# state_dict round trips, fuse, from_env, install
# --------------------------------------------------------------------------------------------

TWINS = [
    (
        lambda p: FusedAdamW(p, lr=1e-2, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    ),
    (
        lambda p: FusedAdam(p, lr=1e-2, adam_w_mode=False, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    ),
    (
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
]


@pytest.mark.parametrize(("make_ours", "make_torch"), TWINS)
@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_state_dict_moves_between_twins(make_ours, make_torch, direction) -> None:
    ps = make_params(SHAPES, torch.float32)
    first, second = (
        (make_ours, make_torch) if direction == "ours->torch" else (make_torch, make_ours)
    )
    a = clones(ps)
    opt_a = first(a)
    lockstep([(opt_a, a)], 3)
    # Continue on the same optimizer, and on the twin loaded from its state_dict.
    b = clones(a)
    opt_b = second(b)
    # deepcopy: as a checkpoint on disk would be (a live state_dict shares its tensors).
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert set(opt_b.state[b[0]]) == set(opt_a.state[a[0]])
    lockstep([(opt_a, a), (opt_b, b)], 5)
    _exact(a, b)


def test_fuse_keeps_groups_hyperparameters_and_state() -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}
    ta = torch.optim.AdamW(_groups(a, lr=1e-3), **kw)
    tb = torch.optim.AdamW(_groups(b, lr=1e-3), **kw)
    lockstep([(ta, a), (tb, b)], 3)
    fused = aiak.optim.fuse(ta)
    assert isinstance(fused, FusedAdamW) and len(fused.param_groups) == 2
    assert fused.param_groups[1]["lr"] == 1e-3 and fused.param_groups[1]["params"] == a[3:]
    lockstep([(fused, a), (tb, b)], 5)
    _exact(a, b)
    sgd = aiak.optim.fuse(torch.optim.SGD(clones(ps), lr=0.1, momentum=0.9, nesterov=True))
    assert isinstance(sgd, FusedSGD) and sgd.param_groups[0]["nesterov"]
    adam = aiak.optim.fuse(torch.optim.Adam(clones(ps), lr=0.1))
    assert isinstance(adam, FusedAdam) and not adam.param_groups[0]["adam_w_mode"]
    with pytest.raises(TypeError, match="optimizer must be"):
        aiak.optim.fuse(torch.optim.RMSprop(clones(ps)))


def test_from_env(monkeypatch) -> None:
    opt = torch.optim.SGD(clones(make_params([(3,)], torch.float32)), lr=0.1)
    monkeypatch.delenv("AIAK_FUSED_OPTIMIZER", raising=False)
    assert aiak.optim.from_env(opt) is opt
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "1")
    assert isinstance(aiak.optim.from_env(opt), FusedSGD)
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "yes")
    with pytest.raises(ValueError, match="AIAK_FUSED_OPTIMIZER"):
        aiak.optim.from_env(opt)


def test_install_is_reversible() -> None:
    assert not hasattr(torch.optim, "LAMB")
    aiak.optim.install()
    try:
        assert torch.optim.LAMB is LAMB
        aiak.optim.install()  # twice is harmless
    finally:
        aiak.optim.uninstall()
    assert not hasattr(torch.optim, "LAMB")
    aiak.optim.uninstall()  # and so is undoing twice


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _p(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, requires_grad=True)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: FusedAdamW([_p(2)], lr=-1.0), ValueError, "lr must be >= 0"),
        (lambda: FusedAdam([_p(2)], eps=-1e-8), ValueError, "eps must be >= 0"),
        (lambda: FusedAdam([_p(2)], betas=(1.0, 0.9)), ValueError, r"betas\[0\]"),
        (lambda: FusedAdam([_p(2)], betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (lambda: FusedAdam([_p(2)], betas=0.9), TypeError, "betas must be a pair"),
        (lambda: FusedSGD([_p(2)], lr=0.1, momentum=-0.5), ValueError, "momentum must be >= 0"),
        (lambda: FusedSGD([_p(2)], lr=0.1, nesterov=True), ValueError, "nesterov"),
        (lambda: LAMB([_p(2)], weight_decay=-1.0), ValueError, "weight_decay must be >= 0"),
        (lambda: FusedLAMB([_p(2)], amsgrad=True), ValueError, "amsgrad"),
        (lambda: LARS([_p(2)], lr=0.1, trust_coefficient=-1.0), ValueError, "trust_coefficient"),
        (lambda: FusedAdamW([torch.zeros(2, dtype=torch.int64)]), TypeError, r"\['params'\]\[0\]"),
        (lambda: FusedAdamW([_p(2), torch.zeros(2, device="meta")]), ValueError, "several devices"),
        (
            lambda: FusedAdamW([{"params": [_p(2)]}, {"params": [_p(3)], "lr": -2.0}]),
            ValueError,
            r"param_groups\[1\].*lr",
        ),
        (lambda: FusedAdamW([_p(2)], differentiable=True), ValueError, "differentiable"),
    ],
)
def test_bad_arguments_name_the_argument(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make()


def test_sparse_grad_is_refused() -> None:
    p = _p(4)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match=r"params\[0\] has a sparse grad"):
        FusedAdamW([p]).step()


def _adam_op_args(**change: object) -> list[object]:
    """Valid aiak::fused_adam_ arguments for one 3-element param, with ``change`` applied."""
    t = [torch.zeros(3)]
    good = aiak.ops.fused_adam_.Args(
        t,
        [torch.zeros(3)],
        [torch.zeros(3)],
        [torch.zeros(3)],
        [],
        [torch.zeros(())],
        [],
        0.1,
        None,
        0.9,
        0.99,
        1e-8,
        0.0,
        True,
        False,
        False,
        True,
        None,
        None,
    )
    return list(good._replace(**change))


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"exp_avgs": []}, ValueError, "exp_avgs has 0 tensors"),
        ({"exp_avgs": [torch.zeros(3).half()]}, TypeError, r"exp_avgs\[0\] is torch.float16"),
        ({"grads": [torch.zeros(4)]}, ValueError, r"grads\[0\] \(shape \(4,\)"),
        ({"beta2": 1.0}, ValueError, "beta2 must be in"),
        ({"state_steps": [torch.zeros(2)]}, ValueError, r"state_steps\[0\] must have one element"),
        ({"found_inf": torch.zeros(1, dtype=torch.int32)}, TypeError, "found_inf must be"),
    ],
)
def test_op_rejects_bad_lists(change, exc, match) -> None:
    with pytest.raises(exc, match=match):
        torch.ops.aiak.fused_adam_(*_adam_op_args(**change))


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
    _exact(a, b)


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
