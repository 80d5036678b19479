"""O2 loss-scale policy: LossScaler against a plain-Python model of apex's rules, the native
GradScaler under the policy (growth, backoff, clamps, static), install()/uninstall()."""

from __future__ import annotations

import pytest
import torch
from _amp_helpers import mlp
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

import aiak.amp as amp
from aiak.amp import LossScalePolicy, LossScaler


def _apex_model(policy: LossScalePolicy, overflows: list[bool]) -> list[float]:
    """apex's LossScaler.update_scale, written out: the scale after each step."""
    scale, clean, out = policy.init_scale, 0, []
    for overflow in overflows:
        if policy.static:
            pass
        elif overflow:
            scale *= policy.backoff_factor
            if policy.min_scale is not None:
                scale = max(scale, policy.min_scale)
            clean = 0
        else:
            clean += 1
            if clean == policy.growth_interval:
                scale = min(scale * policy.growth_factor, policy.max_scale)
                clean = 0
        out.append(scale)
    return out


@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    interval=st.integers(1, 4),
    min_exp=st.none() | st.integers(8, 15),
    max_exp=st.integers(16, 19),
    static=st.booleans(),
)
def test_loss_scaler_follows_apex_rules(
    overflows: list[bool], interval: int, min_exp: int | None, max_exp: int, static: bool
) -> None:
    policy = LossScalePolicy(
        init_scale=2.0**16,
        growth_interval=interval,
        min_scale=None if min_exp is None else 2.0**min_exp,
        max_scale=2.0**max_exp,
        static=static,
    )
    scaler = LossScaler(policy)
    scaler.scale(torch.device("cpu"))
    got = []
    for overflow in overflows:
        scaler.update(torch.tensor(float(overflow)))
        got.append(scaler.get_scale())
    assert got == _apex_model(policy, overflows)


def test_policy_from_decorate_arguments() -> None:
    assert LossScalePolicy.o2() == LossScalePolicy()
    assert LossScalePolicy.o2("dynamic", 1.0, 2.0**10).init_scale == 2.0**10  # min(2^16, max)
    static = LossScalePolicy.o2(128)
    assert static.static and static.init_scale == 128.0
    with pytest.raises(ValueError, match="growth_interval must be in 1"):
        LossScalePolicy(growth_interval=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScalePolicy(backoff_factor=2.0)


def _tiny(**decorate_kwargs):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return (*amp.decorate(model, opt, **decorate_kwargs), torch.randn(8, 6), torch.arange(8) % 3)


def _step(model, opt, scaler, x, y, overflow: bool = False) -> None:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    if overflow:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("make", ["subclass", "install"])
def test_native_gradscaler_follows_o2_whatever_it_was_built_with(make: str) -> None:
    model, opt, x, y = _tiny(min_loss_scale=2.0**14)
    kwargs = {"growth_interval": 1, "growth_factor": 4.0, "backoff_factor": 0.1}
    if make == "install":
        amp.install()
    try:
        cls = amp.GradScaler if make == "subclass" else torch.amp.GradScaler
        scaler = cls("cpu", **kwargs)
        _step(model, opt, scaler, x, y)
        assert scaler.get_scale() == 2.0**16, "user's growth_interval=1 must not apply"
        _step(model, opt, scaler, x, y, overflow=True)
        assert scaler.get_scale() == 2.0**15, "backoff is /2, not the user's 0.1"
        _step(model, opt, scaler, x, y, overflow=True)
        _step(model, opt, scaler, x, y, overflow=True)
        assert scaler.get_scale() == 2.0**14, "min_loss_scale clamps the backoff"
        state = scaler.state_dict()
        assert (state["growth_factor"], state["backoff_factor"]) == (2.0, 0.5)
        assert state["growth_interval"] == 2000
    finally:
        amp.uninstall()


def test_gradscaler_of_an_undecorated_optimizer_is_untouched() -> None:
    amp.install()
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", growth_interval=1)
        x, y = torch.randn(8, 6), torch.arange(8) % 3
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**17
    finally:
        amp.uninstall()


def test_static_loss_scale_with_gradscaler() -> None:
    model, opt, x, y = _tiny(loss_scale=128.0)
    scaler = amp.GradScaler("cpu", init_scale=128.0)
    for overflow in (False, True, False):
        before = [m.detach().clone() for m in amp.parameters(opt)]
        _step(model, opt, scaler, x, y, overflow=overflow)
        assert scaler.get_scale() == 128.0
        moved = any(not torch.equal(b, m) for b, m in zip(before, amp.parameters(opt)))
        assert moved != overflow, "an overflowing step is skipped, the others are not"


def test_growth_after_2000_clean_steps_and_max_clamp() -> None:
    """x2 after exactly 2000 clean steps; max_loss_scale caps it. Two runs side by side; the
    scalers start 1995 clean steps in (GradScaler's own state_dict) to save 1995 iterations."""
    free = _tiny()
    capped = _tiny(max_loss_scale=2.0**16)
    scalers = [amp.GradScaler("cpu", growth_interval=10), amp.GradScaler("cpu")]
    for scaler in scalers:
        state = dict(scaler.state_dict(), _growth_tracker=1995)
        scaler.load_state_dict(state)
    for i in range(5):
        for (model, opt, x, y), scaler in zip((free, capped), scalers):
            _step(model, opt, scaler, x, y)
        if i == 3:
            assert [s.get_scale() for s in scalers] == [2.0**16, 2.0**16]
            assert [s._get_growth_tracker() for s in scalers] == [1999, 1999]
    assert [s.get_scale() for s in scalers] == [2.0**17, 2.0**16]


def test_install_is_reversible_and_idempotent() -> None:
    update = torch.amp.GradScaler.update
    assert "update" not in vars(torch.cuda.amp.GradScaler)
    assert not hasattr(torch.cuda.amp, "aiak_amp_decorate")
    amp.install()
    amp.install()
    try:
        assert amp.installed()
        assert torch.cuda.amp.aiak_amp_decorate is amp.decorate
        assert torch.cuda.amp.aiak_amp_parameters is amp.parameters
        assert torch.amp.aiak_amp_decorate is amp.decorate
        assert torch.amp.aiak_amp_parameters is amp.parameters
        assert torch.amp.GradScaler.update is not update
        assert torch.cuda.amp.GradScaler.update is torch.amp.GradScaler.update
    finally:
        amp.uninstall()
        amp.uninstall()
    assert not amp.installed()
    assert torch.amp.GradScaler.update is update
    assert "update" not in vars(torch.cuda.amp.GradScaler)
    for name in ("aiak_amp_decorate", "aiak_amp_parameters"):
        assert not hasattr(torch.cuda.amp, name) and not hasattr(torch.amp, name)
