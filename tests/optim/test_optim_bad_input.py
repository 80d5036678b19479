"""aiak.optim's public API under bad input: every call works as documented or raises
ValueError/TypeError naming the argument; never an error from deep inside torch.

Also the two wrong-results cases found by hand: LAMB on float64 params, and FusedSGD with
dampening when GradScaler skips the very first step.
"""

from __future__ import annotations

import math

import pytest
import torch
from _optim_helpers import SHAPES, clones, make_params
from hypothesis import given, settings
from hypothesis import strategies as st

import aiak.ops
from aiak.optim import LAMB, LARS, FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

ALL = {
    "FusedAdam": FusedAdam,
    "FusedAdamW": FusedAdamW,
    "FusedSGD": FusedSGD,
    "FusedLAMB": FusedLAMB,
    "LAMB": LAMB,
    "LARS": LARS,
}


def _p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


# --------------------------------------------------------------------------------------------
# The two hand-found cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [LAMB, FusedLAMB])
def test_lamb_float64_params_step(cls) -> None:
    """float64 params were accepted and then failed inside linalg.vector_norm (dtype mismatch):
    they step in float64, like the float32 run of the same maths."""
    p64 = [p.double() for p in make_params(SHAPES, torch.float32)]
    a = clones(p64)
    b = [p.detach().float().requires_grad_() for p in p64]
    oa, ob = cls(a, lr=1e-2, weight_decay=0.01), cls(b, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
            x.grad, y.grad = g, g.float()
        oa.step()
        ob.step()
    assert all(x.dtype == torch.float64 for x in a)
    assert all(oa.state[x]["exp_avg"].dtype == torch.float64 for x in a if oa.state[x])
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().float(), y.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dampening", [0.1, 0.5])
def test_sgd_dampening_when_grad_scaler_skips_the_first_step_matches_torch(dampening) -> None:
    """torch creates the momentum buffer on the first *applied* step (GradScaler does not call
    step() on an inf/NaN step); FusedSGD created it before the skip check and then averaged
    into a zero buffer (0.68 off torch after 4 steps)."""
    ps = make_params([(4, 3), (5,)], torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": dampening}
    ours, ref = FusedSGD(a, **kw), torch.optim.SGD(b, foreach=False, **kw)
    sa, sb = (torch.amp.GradScaler("cpu", init_scale=8.0) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for t in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in a]
        if t == 0:
            grads[0][0, 0] = float("inf")  # the very first step is skipped
        for opt, params, scaler in ((ours, a, sa), (ref, b, sb)):
            s = scaler.scale(torch.ones(()))
            for p, g in zip(params, grads):
                p.grad = g * s
            scaler.step(opt)
            scaler.update()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    for x, y in zip(a, b):
        torch.testing.assert_close(
            ours.state[x]["momentum_buffer"], ref.state[y]["momentum_buffer"], rtol=1e-6, atol=0
        )


# --------------------------------------------------------------------------------------------
# Hyper-parameters of the wrong type or range
# --------------------------------------------------------------------------------------------

BAD_NUMBERS = [-1.0, float("nan"), float("inf"), -float("inf"), "0.1", None, [0.1], True]
NUMERIC = {
    "FusedAdam": ["lr", "eps", "weight_decay"],
    "FusedAdamW": ["lr", "eps", "weight_decay"],
    "FusedSGD": ["lr", "momentum", "dampening", "weight_decay"],
    "FusedLAMB": ["lr", "eps", "weight_decay"],
    "LAMB": ["lr", "eps", "weight_decay"],
    "LARS": ["lr", "momentum", "weight_decay", "trust_coefficient", "eps"],
}


@given(
    name=st.sampled_from(sorted(NUMERIC)),
    data=st.data(),
    value=st.sampled_from(BAD_NUMBERS),
)
@settings(max_examples=120, deadline=None)
def test_bad_numbers_name_the_argument(name, data, value) -> None:
    arg = data.draw(st.sampled_from(NUMERIC[name]))
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {}
    kw[arg] = value
    with pytest.raises((ValueError, TypeError), match=arg):
        ALL[name]([_p(3)], **kw)


@given(
    name=st.sampled_from(["FusedAdam", "FusedAdamW", "FusedLAMB", "LAMB"]),
    betas=st.one_of(
        st.tuples(st.floats(allow_nan=True), st.floats(allow_nan=True)).filter(
            lambda b: not all(0.0 <= x < 1.0 for x in b)
        ),
        st.just((0.9,)),
        st.just(0.9),
        st.just(("0.9", 0.999)),
        st.just((0.9, 0.99, 0.9)),
    ),
)
@settings(max_examples=80, deadline=None)
def test_bad_betas_name_the_argument(name, betas) -> None:
    with pytest.raises((ValueError, TypeError), match="betas"):
        ALL[name]([_p(3)], betas=betas)


@given(lr=st.floats(0, 10), wd=st.floats(0, 1), eps=st.floats(1e-12, 1e-2))
@settings(max_examples=30, deadline=None)
def test_good_numbers_step(lr, wd, eps) -> None:
    p = _p(4)
    opt = FusedAdamW([p], lr=lr, weight_decay=wd, eps=eps)
    p.grad = torch.randn(4)
    opt.step()
    assert torch.isfinite(p).all()


def test_sgd_option_combinations() -> None:
    for kw in (
        {"nesterov": True},
        {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
        {"nesterov": 1, "momentum": 0.9},
        {"maximize": "yes"},
    ):
        with pytest.raises((ValueError, TypeError), match=r"nesterov|maximize"):
            FusedSGD([_p(3)], lr=0.1, **kw)
    FusedSGD([_p(3)], lr=0.1, momentum=0.9, nesterov=True)  # valid


@pytest.mark.parametrize("name", sorted(ALL))
def test_flags_must_be_bools(name) -> None:
    flag = {"FusedSGD": "maximize", "LARS": "exclude_1d"}.get(name, "bias_correction")
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {}
    with pytest.raises(TypeError, match=flag):
        ALL[name]([_p(3)], **kw, **{flag: "no"})


# --------------------------------------------------------------------------------------------
# Params and grads of other dtypes, devices, layouts; duplicates
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_params_are_refused(name, dtype) -> None:
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {}
    with pytest.raises(TypeError, match=r"params'\]\[0\]"):
        ALL[name]([torch.zeros(3, dtype=dtype)], **kw)


@pytest.mark.parametrize("name", sorted(ALL))
def test_duplicate_params_are_refused(name) -> None:
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {}
    p = _p(3)
    with pytest.raises(ValueError, match=r"duplicate|more than one|appear"):
        ALL[name]([{"params": [p]}, {"params": [p]}], **kw)


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_every_float_dtype_steps(name, dtype) -> None:
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {"lr": 1e-2}
    ps = [_p(3, 4, dtype=dtype), _p(5, dtype=dtype)]
    opt = ALL[name](ps, **kw)
    before = [p.detach().clone() for p in ps]
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape).to(dtype)
        opt.step()
    assert all(p.dtype == dtype and torch.isfinite(p).all() for p in ps)
    assert any(not torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("name", sorted(ALL))
def test_sparse_and_odd_layout_grads(name) -> None:
    kw = {"lr": 0.1} if name in ("FusedSGD", "LARS") else {}
    p = _p(4, 3)
    opt = ALL[name]([p], **kw)
    p.grad = torch.randn(3, 4).t()  # another layout: copied into the param's, then stepped
    opt.step()
    assert torch.isfinite(p).all()
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(TypeError, match=r"params\[0\]|sparse"):
        opt.step()


def test_non_contiguous_params_step_like_contiguous_ones() -> None:
    base = torch.randn(6, 8)
    a = base[:, ::2].clone().requires_grad_()  # contiguous twin
    b = base.clone()[:, ::2].requires_grad_()  # a strided view
    b = b.detach().requires_grad_()
    oa, ob = FusedAdamW([a], lr=1e-2), FusedAdamW([b], lr=1e-2)
    g = torch.randn(6, 4)
    a.grad, b.grad = g.clone(), g.clone()
    oa.step()
    ob.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lr_tensor_and_bad_lr_tensor() -> None:
    p = _p(3)
    opt = FusedAdamW([p], lr=torch.tensor(0.01))
    p.grad = torch.ones(3)
    opt.step()
    assert math.isfinite(float(p.detach().sum()))
    with pytest.raises(TypeError, match="lr"):
        FusedAdamW([_p(3)], lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="lr"):
        FusedAdamW([_p(3)], lr=torch.tensor(-1.0))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


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
