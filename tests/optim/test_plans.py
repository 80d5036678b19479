"""The cached per-group step plans (aiak.optim._common.Plan): reused while nothing they were
built from changed, rebuilt when something did, and a step with a cached plan is exactly the
step without one.

The oracle is the same optimizer with its plans dropped before every step (every step builds
from the params, grads and state as they are then: what each step did before plans existed),
driven in lock step through the events that must rebuild a plan. Both paths run: the foreach
path of ``aiak.ops`` (on CPU the op runs its reference).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _optim_helpers import clones, make_params

from aiak.optim import LAMB, LARS, FusedAdam, FusedAdamW, FusedSGD

SHAPES = [(3, 5), (7,), (1,), (4, 2), (2, 1, 4), (6,)]

MAKERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "adamw": lambda g: FusedAdamW(g, lr=1e-2, weight_decay=0.01),
    "adam-amsgrad": lambda g: FusedAdam(g, lr=1e-2, adam_w_mode=False, amsgrad=True),
    "sgd": lambda g: FusedSGD(g, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-plain": lambda g: FusedSGD(g, lr=0.1),
    "lamb": lambda g: LAMB(g, lr=1e-2, weight_decay=0.01),
    "lars": lambda g: LARS(g, lr=0.1, weight_decay=1e-4),
}


def _groups(ps: list[torch.Tensor]) -> list[dict]:
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 5e-3}]


def _plans(opt: torch.optim.Optimizer) -> list:
    return list(opt.__dict__.get("_aiak_plans") or [])


def _same_state(a: torch.optim.Optimizer, pa: list, b: torch.optim.Optimizer, pb: list) -> None:
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=0, atol=0)
        assert set(a.state[x]) == set(b.state[y])
        for k in a.state[x]:
            torch.testing.assert_close(a.state[x][k], b.state[y][k], rtol=0, atol=0)


@pytest.fixture
def path():
    """One path now: the op (its reference, on CPU)."""
    return "ops"


@pytest.mark.parametrize("name", list(MAKERS))
def test_cached_plans_step_exactly_like_fresh_ones(name, path) -> None:
    make = MAKERS[name]
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    opt_a, opt_b = make(_groups(a)), make(_groups(b))
    gen = torch.Generator().manual_seed(0)
    extra_a, extra_b = clones(make_params([(5,), (2, 3)], torch.float32)), None
    extra_b = [x.detach().clone().requires_grad_() for x in extra_a]
    models_a = models_b = None

    def step(skip: tuple[int, ...] = ()) -> None:
        """Fresh grads (zero_grad(set_to_none=True) first), none for ``skip``; one step."""
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(zip(a, b)):
            if i in skip:
                continue
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b._drop_plans()  # the oracle: built from scratch every step
        opt_b.step()
        _same_state(opt_a, a, opt_b, b)
        if models_a is not None:
            for m, n in zip(models_a, models_b):
                torch.testing.assert_close(m, n, rtol=0, atol=0)

    step()
    step()
    plans = _plans(opt_a)
    step()
    assert _plans(opt_a) == plans, "steady state: the plans are reused"
    assert all(x is y for x, y in zip(_plans(opt_a), plans))

    # Grads missing for some params (param 4 never had one until the step after).
    step(skip=(1, 4))
    assert _plans(opt_a)[0] is not plans[0] and _plans(opt_a)[1] is not plans[1]
    step(skip=(4,))
    step()
    step()

    # A state tensor replaced, a param's state dict reset, an entry deleted.
    if opt_a.state[a[0]]:
        for opt, x in ((opt_a, a[0]), (opt_b, b[0])):
            for k, v in list(opt.state[x].items()):
                opt.state[x][k] = v * 0.5
        plans = _plans(opt_a)
        step()
        assert _plans(opt_a)[0] is not plans[0]
        for opt, x in ((opt_a, a[2]), (opt_b, b[2])):
            opt.state[x] = {}
        step()
        for opt, x in ((opt_a, a[3]), (opt_b, b[3])):
            del opt.state[x]
        step()

    # add_param_group.
    opt_a.add_param_group({"params": extra_a})
    opt_b.add_param_group({"params": extra_b})
    a, b = a + extra_a, b + extra_b
    step()
    step()

    # load_state_dict (new state objects; the same values).
    plans = _plans(opt_a)
    opt_a.load_state_dict(opt_a.state_dict())
    opt_b.load_state_dict(opt_b.state_dict())
    step()
    assert all(x is not y for x, y in zip(_plans(opt_a), plans))
    step()

    # amp copy-back: a mapping set, then replaced by one with other targets.
    models_a = [x.detach().to(torch.bfloat16) for x in a]
    models_b = [x.detach().to(torch.bfloat16) for x in b]
    opt_a._aiak_copy_back = dict(zip(a[1:], models_a[1:]))
    opt_b._aiak_copy_back = dict(zip(b[1:], models_b[1:]))
    step()
    for x, m in zip(a[1:], models_a[1:]):
        torch.testing.assert_close(m, x.detach().to(torch.bfloat16), rtol=0, atol=0)
    models_a = [x.detach().to(torch.bfloat16) for x in a]
    models_b = [x.detach().to(torch.bfloat16) for x in b]
    opt_a._aiak_copy_back = dict(zip(a[:2], models_a[:2]))
    opt_b._aiak_copy_back = dict(zip(b[:2], models_b[:2]))
    step()
    for x, m in zip(a[:2], models_a[:2]):
        torch.testing.assert_close(m, x.detach().to(torch.bfloat16), rtol=0, atol=0)
    del opt_a._aiak_copy_back, opt_b._aiak_copy_back
    models_a = models_b = None

    # A param swapped in a group's params list, in place.
    new = torch.randn(3, 5, generator=gen)
    for opt, ps_ in ((opt_a, a), (opt_b, b)):
        ps_[0] = new.clone().requires_grad_()
        opt.param_groups[0]["params"][0] = ps_[0]
    step()
    step()


def test_plan_is_reused_after_zero_grad_and_matches_torch() -> None:
    """zero_grad(set_to_none=True) and new grads: same plan, torch AdamW's trajectory."""
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    ours = FusedAdamW(a, lr=1e-2)
    ref = torch.optim.AdamW(b, lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(6):
        ours.zero_grad()
        ref.zero_grad()
        assert all(p.grad is None for p in a)
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        seen.add(id(_plans(ours)[0]))
    assert len(seen) == 1
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_sgd_params_getting_their_first_grad_late_match_torch(path) -> None:
    """Momentum buffers: set to the grad on a param's first step, also when other params of the
    group are past theirs (the plan with first-step params is used once, then rebuilt)."""
    ps = make_params(SHAPES, torch.float32)
    a, b = clones(ps), clones(ps)
    ours = FusedSGD(a, lr=0.1, momentum=0.9, dampening=0.1)
    ref = torch.optim.SGD(b, lr=0.1, momentum=0.9, dampening=0.1, foreach=True)
    gen = torch.Generator().manual_seed(2)
    for skip in [(1, 2, 5), (2, 5), (5,), (), (), (0,), ()]:
        for x, y in zip(a, b):
            x.grad = y.grad = None
        for i, (x, y) in enumerate(zip(a, b)):
            if i not in skip:
                g = torch.randn(x.shape, generator=gen)
                x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        # The op's reference is torch's foreach SGD, op for op: bit for bit.
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_amsgrad_switched_on_rebuilds_the_plan() -> None:
    p = torch.randn(4, requires_grad=True)
    opt = FusedAdam([p], lr=1e-2)
    for amsgrad in (False, True, True):
        opt.param_groups[0]["amsgrad"] = amsgrad
        p.grad = torch.randn(4)
        opt.step()
    assert "max_exp_avg_sq" in opt.state[p]
    assert float(opt.state[p]["step"]) == 3.0


@pytest.mark.parametrize("shape", [(4,), ()])
def test_sparse_grad_after_the_plan_is_built_is_refused(shape, path) -> None:
    """A later step's sparse grad is refused too (also for a 0-dim param, whose strides a COO
    grad's all-zero strides equal)."""
    p = torch.zeros(shape, requires_grad=True)
    opt = FusedAdamW([torch.zeros(3, requires_grad=True), p])
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    opt.step()
    p.grad = torch.ones(shape).to_sparse()
    with pytest.raises(TypeError, match=r"params\[1\] has a sparse grad"):
        opt.step()


def test_deepcopy_rebuilds_plans() -> None:
    import copy

    p = torch.randn(4, requires_grad=True)
    opt = LAMB([p], lr=1e-2)
    p.grad = torch.randn(4)
    opt.step()
    twin = copy.deepcopy(opt)
    q = twin.param_groups[0]["params"][0]
    q.grad = p.grad.clone()
    opt.step()
    twin.step()
    torch.testing.assert_close(p, q, rtol=0, atol=0)
