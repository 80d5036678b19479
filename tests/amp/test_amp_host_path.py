"""The cached copy plans of amp's step path: reused while the tensors stay, rebuilt when not.

amp keeps the grad copy and the copy-back prepared across steps (host time, see
``research/profile_amp_host.py``); these tests change the tensors under it in every way a
training script can (new grads each step, a replaced grad, a grad or param given new storage,
a param with no grad this time, channels_last) and check that the masters still mirror the
model grads after every backward and the model holds the masters after every step.
"""

from __future__ import annotations

import pytest
import torch
from _amp_helpers import conv_net, image_data
from torch.nn import functional as F

import aiak.amp as amp
from aiak.amp import _multi_tensor

HAS_OP = _multi_tensor.default_backend() == "aiak"
BACKENDS = [
    "foreach",
    pytest.param("aiak", marks=pytest.mark.skipif(not HAS_OP, reason="aiak.ops op absent")),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _decorated(backend: str, channels_last: bool = False, dtype=torch.bfloat16):
    model = conv_net()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.decorate(model, opt, dtype=dtype)
    amp.state_of(opt).backend = amp.state_of(opt).copy_backend = backend
    return model, opt


def _backward(model, x, y) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()


def _assert_mirrored(opt) -> None:
    state = amp.state_of(opt)
    for p, m in zip(state.model_params, state.masters):
        if p.grad is None:
            assert m.grad is None
        else:
            assert m.grad is not None and torch.equal(m.grad, p.grad.float())


def _assert_copied_back(opt) -> None:
    state = amp.state_of(opt)
    for p, m in zip(state.model_params, state.masters):
        assert torch.equal(p, m.to(p.dtype))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_masters_mirror_grads_every_step(backend: str, channels_last: bool, set_to_none: bool):
    """New grad tensors each step (set_to_none=True, the default) and the same ones reused
    (False) both reach the masters, contiguous or channels_last (aliased for the op)."""
    model, opt = _decorated(backend, channels_last)
    x, y = image_data(8)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
        assert any(not p.is_contiguous() for p in model.parameters())
    for _ in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        _backward(model, x, y)
        _assert_mirrored(opt)
        opt.step()
        _assert_copied_back(opt)


def test_a_replaced_grad_is_noticed(backend: str) -> None:
    """zero_grad(set_to_none=False) keeps the grads, so the plan is reused; a grad the script
    replaces (a new tensor object) must still be the one copied."""
    model, opt = _decorated(backend)
    x, y = image_data(8)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        if step == 2:
            p = amp.state_of(opt).model_params[0]
            p.grad = torch.full_like(p.grad, 0.5)  # backward accumulates onto it
        _backward(model, x, y)
        _assert_mirrored(opt)
        opt.step()
        _assert_copied_back(opt)


@pytest.mark.parametrize("channels_last", [False, True])
def test_storage_swapped_under_the_same_tensors_is_noticed(backend: str, channels_last: bool):
    """``t.data = ...`` keeps the tensor object and moves its memory: a plan's aliases of the
    old memory must not be used (checked for a grad and for a model param)."""
    model, opt = _decorated(backend, channels_last)
    x, y = image_data(8)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    state = amp.state_of(opt)
    conv = state.model_params[0]  # the first conv weight (4-d: channels_last when asked)
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        if step == 2:
            conv.grad.data = conv.grad.data.clone()  # same grad object, new storage
        if step == 3:
            conv.data = conv.data.clone()  # same param object, new storage
        _backward(model, x, y)
        _assert_mirrored(opt)
        opt.step()
        _assert_copied_back(opt)


def test_a_param_without_grad_this_time(backend: str) -> None:
    """A param that backward leaves without a grad has no master grad (the optimizer skips
    it), and gets one again when it is used again."""
    model, opt = _decorated(backend)
    x, y = image_data(8)
    head = model[-1]
    for step in range(5):
        opt.zero_grad()
        if step in (1, 2):
            # A loss that does not reach the head: its params get no grad.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model[:-1](x).float().pow(2).mean()
            loss.backward()
            state = amp.state_of(opt)
            assert head.weight.grad is None
            i = next(i for i, p in enumerate(state.model_params) if p is head.weight)
            assert state.masters[i].grad is None
        else:
            _backward(model, x, y)
        _assert_mirrored(opt)
        opt.step()
        _assert_copied_back(opt)


def test_scale_loss_after_a_step_without_zero_grad_starts_afresh(backend: str) -> None:
    """The masters keep their grads after a step; a scale_loss iteration that follows without
    zero_grad must not add the last step's grads to its own. (No BatchNorm: fp32 params
    accumulate without zero_grad, as in torch; the half ones are consumed by each loss.)"""
    runs = []
    for zero_grad in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 16), torch.nn.ReLU(),
            torch.nn.Linear(16, 10),
        )  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = amp.decorate(model, opt, dtype=torch.float16)
        amp.state_of(opt).backend = amp.state_of(opt).copy_backend = backend
        x, y = image_data(8)
        for _ in range(3):
            if zero_grad:
                opt.zero_grad()
            with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
        runs.append(torch.cat([m.detach().flatten() for m in amp.parameters(opt)]))
    assert torch.equal(runs[0], runs[1])


def test_plan_aliases_channels_last_pairs_and_checks_their_storage() -> None:
    src = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(7)]
    dst = [torch.empty_like(src[0], dtype=torch.float16), torch.empty(7, dtype=torch.float16)]
    plan = _multi_tensor.Plan(src, dst, "aiak")
    _, s_list, d_list = plan._groups[0]
    assert all(t.is_contiguous() for t in s_list + d_list)  # what the op caches tables for
    assert s_list[0].data_ptr() == src[0].data_ptr() and s_list[1] is src[1]
    assert plan.valid()
    src[0].data = src[0].data.clone()
    assert not plan.valid()
    # A source of another layout cannot take the alias's place: prepare anew.
    assert plan.with_src([src[0].contiguous(), src[1]]) is None
    again = plan.with_src([src[0], torch.randn(7)])
    assert again is not None and again.valid()
    # The foreach kernels take any strides: no aliases, nothing to go stale.
    assert _multi_tensor.Plan(src, dst, "foreach")._aliased == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_copy_and_scale_match_torch(backend: str) -> None:
    src = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(7)]
    src = [t.half() for t in src]
    dst = [torch.empty_like(t, dtype=torch.float32) for t in src]
    plan = _multi_tensor.Plan(src, dst, backend)
    plan.copy_()
    assert all(torch.equal(d, s.float()) for s, d in zip(src, dst))
    found = torch.zeros(())
    plan.scale_(torch.tensor(0.5), found)
    assert all(torch.equal(d, s.float() * 0.5) for s, d in zip(src, dst)) and found.item() == 0
    src[1][3] = float("inf")
    plan.scale_(torch.tensor(0.5), found)
    assert found.item() == 1.0


def test_unit_scalars_are_made_once_per_device() -> None:
    one, scratch = _multi_tensor.unit_scalars(torch.device("cpu"))
    assert one.item() == 1.0 and scratch.dtype == torch.float32
    assert _multi_tensor.unit_scalars(torch.device("cpu"))[0] is one
