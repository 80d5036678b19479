"""Checkpoints: a resumed O2 run continues bit-identically to an uninterrupted one (apex lost
its masters on resume: apex issues #180, #388, #213, #250)."""

from __future__ import annotations

import io

import pytest
import torch
from _amp_helpers import conv_net, flat, image_data, seed_step
from torch.nn import functional as F

import aiak.amp as amp

STEPS, SPLIT = 6, 3


def _build(seed: int, num_losses: int = 1):
    model = conv_net(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.decorate(model, opt, num_losses=num_losses)
    return model, opt, amp.GradScaler("cpu")


def _native_iteration(model, opt, scaler, x, y, i: int) -> None:
    # Step 1 overflows, so the scaler's state (scale, growth tracker) is not trivial.
    hook = (lambda loss: loss * float("inf")) if i == 1 else None
    seed_step(model, opt, scaler, x, y, torch.float16, loss_hook=hook)


def _apex_iteration(model, opt, scaler, x, y, i: int) -> None:
    opt.zero_grad()
    out = model(x)
    losses = [F.cross_entropy(out, y), out.pow(2).mean()]
    if i == 1:
        losses[1] = losses[1] * float("inf")
    for k, loss in enumerate(losses):
        with amp.scale_loss(loss, opt, loss_id=k) as scaled:
            scaled.backward(retain_graph=k == 0)
    opt.step()


def _snapshot(model, opt, scaler) -> dict:
    return {
        "model": flat(model.state_dict().values()),
        "masters": flat(amp.parameters(opt)),
        "adam": flat(t for s in opt.state.values() for t in s.values()),
        "scaler": scaler.state_dict(),
        "loss_scales": [s.state_dict() for s in amp.state_of(opt).loss_scalers],
        "skipped": amp.state_of(opt).skipped_steps,
    }


@pytest.mark.parametrize("path", ["native", "scale_loss"])
def test_resume_is_bit_identical(path: str) -> None:
    iteration = _native_iteration if path == "native" else _apex_iteration
    num_losses = 1 if path == "native" else 2
    x, y = image_data(16)

    model, opt, scaler = _build(0, num_losses)
    for i in range(STEPS):
        iteration(model, opt, scaler, x, y, i)
    uninterrupted = _snapshot(model, opt, scaler)

    model, opt, scaler = _build(0, num_losses)
    for i in range(SPLIT):
        iteration(model, opt, scaler, x, y, i)
    buffer = io.BytesIO()
    torch.save(amp.state_dict(model, opt, scaler), buffer)
    del model, opt, scaler

    # A fresh process would build the model from another seed: nothing may leak from it.
    model, opt, scaler = _build(123, num_losses)
    buffer.seek(0)
    amp.load_state_dict(torch.load(buffer, weights_only=True), model, opt, scaler)
    for i in range(SPLIT, STEPS):
        iteration(model, opt, scaler, x, y, i)
    resumed = _snapshot(model, opt, scaler)

    assert uninterrupted["skipped"] == (1 if path == "scale_loss" else 0)
    for key, value in uninterrupted.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed[key], value), f"{key} differs after resume"
        else:
            assert resumed[key] == value, key


def test_optimizer_state_dict_carries_exact_masters() -> None:
    _, opt, _ = _build(0)
    sd = opt.state_dict()
    assert sd["aiak_amp"]["dtype"] == "float16"
    masters = sd["aiak_amp"]["masters"]
    assert all(m.dtype == torch.float32 for m in masters)
    # fp16 cannot hold these values: the fp32 masters must not be derived from the half model.
    half = amp.state_of(opt).model_params
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, half))


def test_loading_model_weights_alone_refreshes_masters() -> None:
    """model.load_state_dict after decorate must not be undone by the next copy-back."""
    model, opt, _ = _build(0)
    other = dict(conv_net(7).named_parameters())
    model.load_state_dict(conv_net(7).state_dict())
    x, y = image_data(8)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.param_groups[0]["lr"] = 0.0  # the step copies the masters back and changes nothing else
    opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, other[name].detach().to(p.dtype)), name


def test_load_rejects_mismatched_checkpoint() -> None:
    _, opt, _ = _build(0)
    sd = opt.state_dict()
    sd["aiak_amp"] = dict(sd["aiak_amp"], masters=sd["aiak_amp"]["masters"][:-1])
    with pytest.raises(ValueError, match="masters"):
        opt.load_state_dict(sd)
