"""state_dict round trips between aiak and torch twins, fuse, from_env, install."""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_helpers import (
    SHAPES,
    clones,
    exact,
    groups,
    lockstep,
    make_params,
)

import aiak.ops
import aiak.optim
from aiak.optim import LAMB, FusedAdam, FusedAdamW, FusedSGD

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
    exact(a, b)


def test_fuse_keeps_groups_hyperparameters_and_state() -> None:
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}
    ta = torch.optim.AdamW(groups(a, lr=1e-3), **kw)
    tb = torch.optim.AdamW(groups(b, lr=1e-3), **kw)
    lockstep([(ta, a), (tb, b)], 3)
    fused = aiak.optim.fuse(ta)
    assert isinstance(fused, FusedAdamW) and len(fused.param_groups) == 2
    assert fused.param_groups[1]["lr"] == 1e-3 and fused.param_groups[1]["params"] == a[3:]
    lockstep([(fused, a), (tb, b)], 5)
    exact(a, b)
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
