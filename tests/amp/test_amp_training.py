"""O2 training on CPU: AIAK-Training's documented loop in its variants, against fp32 training
of the same model.

Tolerances (measured here: fp16 0.03%, bf16 0.08% worst relative loss gap over 100 steps):
fp16 <= 0.5% and bf16 <= 1% of the fp32 loss at every step; the loss must also halve, so a run
that does not train (no copy-back, lost updates) fails.
"""

from __future__ import annotations

import pytest
import torch
from _amp_helpers import conv_net, flat, fp32_step, fp32_twin, image_data, rel_err, seed_step
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp
from aiak.amp import _multi_tensor

LOSS_TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
# Relative L2 error of the weight update (after - before) vs fp32 after a few steps.
UPDATE_TOL = {torch.float16: 5e-2, torch.bfloat16: 8e-2}


def _backends() -> list:
    return [
        "foreach",
        pytest.param(
            "aiak",
            marks=pytest.mark.skipif(
                _multi_tensor.default_backend() != "aiak",
                reason="torch.ops.aiak.multi_tensor_scale_ is not registered (aiak.ops absent)",
            ),
        ),
    ]


@pytest.fixture(params=_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _decorated(dtype: torch.dtype, backend: str, **kwargs):
    model = conv_net()
    ref, ref_opt = fp32_twin(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.decorate(model, opt, dtype=dtype, **kwargs)
    amp.state_of(opt).backend = amp.state_of(opt).copy_backend = backend
    return model, opt, ref, ref_opt


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_net_tracks_fp32_loss_over_100_steps(dtype: torch.dtype) -> None:
    # One backend here (the default: the aiak op when present); both are compared elsewhere.
    model, opt, ref, ref_opt = _decorated(dtype, _multi_tensor.default_backend())
    scaler = amp.GradScaler("cpu") if dtype == torch.float16 else None
    x, y = image_data()
    ours = torch.tensor([seed_step(model, opt, scaler, x, y, dtype) for _ in range(100)])
    theirs = torch.tensor([fp32_step(ref, ref_opt, x, y) for _ in range(100)])
    assert theirs[-1] < 0.6 * theirs[0], "the fp32 reference must actually train"
    gap = ((ours - theirs).abs() / theirs).max().item()
    assert gap <= LOSS_TOL[dtype], f"O2 loss strays {gap:.2e} from fp32 (tol {LOSS_TOL[dtype]})"
    # The half model is exactly the rounded masters after every step.
    for p, m in zip(amp.state_of(opt).model_params, amp.state_of(opt).masters):
        assert torch.equal(p, m.to(dtype))


def _run_variant(variant: str, backend: str) -> tuple[float, float]:
    dtype = torch.bfloat16 if variant == "bf16-no-scaler" else torch.float16
    kwargs = {"loss_scale": 256.0} if variant == "static" else {}
    model, opt, ref, ref_opt = _decorated(dtype, backend, **kwargs)
    w0 = flat(ref.parameters())
    scaler = None if variant == "bf16-no-scaler" else torch.amp.GradScaler("cpu")
    clip = None if variant == "no-unscale" else 1.0
    x, y = image_data()
    for _ in range(5):
        seed_step(model, opt, scaler, x, y, dtype, clip=clip)
        fp32_step(ref, ref_opt, x, y, clip=clip)
    err = rel_err(flat(amp.parameters(opt)) - w0, flat(ref.parameters()) - w0)
    return err, (scaler.get_scale() if scaler is not None else 1.0)


@pytest.mark.parametrize("variant", ["unscale-clip", "no-unscale", "static", "bf16-no-scaler"])
def test_seed_loop_variants_match_fp32(variant: str, backend: str) -> None:
    amp.install()
    try:
        err, scale = _run_variant(variant, backend)
    finally:
        amp.uninstall()
    dtype = torch.bfloat16 if variant == "bf16-no-scaler" else torch.float16
    assert err <= UPDATE_TOL[dtype], f"{variant}: update differs from fp32 by {err:.3g}"
    if variant == "static":
        assert scale == 256.0
    elif variant != "bf16-no-scaler":
        assert scale == 2.0**16


def test_seed_spelling_through_install() -> None:
    """The seed's loop, word for word but for the device: torch.cuda.amp.aiak_amp_*."""
    amp.install()
    try:
        model = conv_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = torch.cuda.amp.aiak_amp_decorate(model, optimizer)
        scaler = torch.amp.GradScaler("cpu")
        x, y = image_data(16)
        before = flat(torch.cuda.amp.aiak_amp_parameters(optimizer))
        for inp, target in [(x, y)] * 2:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(inp), target)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(torch.cuda.amp.aiak_amp_parameters(optimizer), 1.0)
            scaler.step(optimizer)
            scaler.update()
        assert not torch.equal(flat(amp.parameters(optimizer)), before)
        assert amp.state_of(optimizer).stage is amp.Stage.COPIED_BACK
    finally:
        amp.uninstall()


def test_injected_inf_skips_step_and_halves_scale(backend: str) -> None:
    model, opt, _, _ = _decorated(torch.float16, backend)
    scaler = amp.GradScaler("cpu", backoff_factor=0.1)  # O2 overrides the user's backoff
    x, y = image_data(16)
    seed_step(model, opt, scaler, x, y, torch.float16)
    masters = flat(amp.parameters(opt)).clone()
    halves = flat(model.parameters()).clone()
    momentum = flat(opt.state[m]["momentum_buffer"] for m in amp.parameters(opt)).clone()
    seed_step(model, opt, scaler, x, y, torch.float16, loss_hook=lambda loss: loss * float("inf"))
    assert scaler.get_scale() == 2.0**15
    assert torch.equal(flat(amp.parameters(opt)), masters)
    assert torch.equal(flat(model.parameters()), halves)
    assert torch.equal(flat(opt.state[m]["momentum_buffer"] for m in amp.parameters(opt)), momentum)
    # The inf grads left in the model do not poison the next iteration (zero_grad clears them).
    seed_step(model, opt, scaler, x, y, torch.float16)
    assert torch.isfinite(flat(amp.parameters(opt))).all()
    assert not torch.equal(flat(amp.parameters(opt)), masters)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradient_accumulation_over_micro_batches(dtype: torch.dtype, backend: str) -> None:
    """4 micro-batches of 8 == one batch of 32: the masters hold exactly what torch
    accumulated in the model, and the step matches fp32 training on the full batch."""
    model, opt, ref, ref_opt = _decorated(dtype, backend)
    w0 = flat(ref.parameters())
    x, y = image_data(32)
    for _ in range(3):
        opt.zero_grad()
        for xb, yb in zip(x.split(8), y.split(8)):
            (F.cross_entropy(model(xb), yb) / 4).backward()
            state = amp.state_of(opt)
            assert state.stage is amp.Stage.MASTER_GRADS_READY
            for p, m in zip(state.model_params, state.masters):
                assert torch.equal(m.grad, p.grad.float())
        opt.step()
        ref_opt.zero_grad()
        for xb, yb in zip(x.split(8), y.split(8)):
            (F.cross_entropy(ref(xb), yb) / 4).backward()
        ref_opt.step()
    err = rel_err(flat(amp.parameters(opt)) - w0, flat(ref.parameters()) - w0)
    assert err <= UPDATE_TOL[dtype]


def test_model_zero_grad_instead_of_optimizer_zero_grad() -> None:
    """Common in user code: model.zero_grad(). The masters mirror the model, so it works."""
    model, opt, ref, ref_opt = _decorated(torch.bfloat16, "foreach")
    x, y = image_data(16)
    for _ in range(3):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        fp32_step(ref, ref_opt, x, y, clip=None)
    assert rel_err(flat(amp.parameters(opt)), flat(ref.parameters())) < 1e-2


class FakeFusedSGD(torch.optim.SGD):
    """Implements amp's copy-back protocol: writes the model params inside its own step."""

    _aiak_supports_copy_back = True

    def step(self, closure=None):
        loss = super().step(closure)
        with torch.no_grad():
            for master, model_param in self._aiak_copy_back.items():
                model_param.copy_(master)
                self.copied += 1
        return loss


def test_fused_optimizer_copies_back_and_amp_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = image_data(16)
    runs = {}
    for cls in (torch.optim.SGD, FakeFusedSGD):
        model = conv_net()
        opt = cls(model.parameters(), lr=0.05, momentum=0.9)
        opt.copied = 0
        amp.decorate(model, opt)
        calls: list[int] = []

        def counting_copy(*args, calls=calls, real=_multi_tensor.Plan.copy_):
            calls.append(1)
            return real(*args)

        # amp copies through cached plans (Plan.copy_), not the one-shot _multi_tensor.copy_.
        monkeypatch.setattr(_multi_tensor.Plan, "copy_", counting_copy)
        scaler = amp.GradScaler("cpu")
        for _ in range(3):
            seed_step(model, opt, scaler, x, y, torch.float16)
        runs[cls] = (flat(model.parameters()), len(calls), opt)
        monkeypatch.undo()
    (plain, plain_grad_and_back, _), (fused, fused_calls, fused_opt) = runs.values()
    assert torch.equal(plain, fused), "the fused copy-back must give the same half weights"
    state = amp.state_of(fused_opt)
    assert fused_opt._aiak_copy_back == dict(zip(state.masters, state.model_params))
    assert all(m.dtype == torch.float32 for m in fused_opt._aiak_copy_back)
    assert fused_opt.copied == 3 * len(state.masters)
    # The plain run copies grads in and masters back (2 per step); the fused one only grads in.
    assert plain_grad_and_back == 6 and fused_calls == 3


def test_scale_loss_multiple_losses_each_with_own_scale(backend: str) -> None:
    """apex style, two losses with separate scales; no GradScaler. Loss 1 overflows once:
    its scale halves, loss 0's does not, and that step is skipped."""
    model, opt, ref, ref_opt = _decorated(torch.float16, backend, num_losses=2)
    w0 = flat(ref.parameters())
    x, y = image_data(16)
    for it in range(4):
        opt.zero_grad()
        out = model(x)
        for loss_id, loss in enumerate([F.cross_entropy(out, y), out.pow(2).mean() * 0.1]):
            if it == 1 and loss_id == 1:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id == 0)
        opt.step()
        if it != 1:
            ref_opt.zero_grad()
            out = ref(x)
            (F.cross_entropy(out, y) + out.pow(2).mean() * 0.1).backward()
            ref_opt.step()
    scalers = amp.state_of(opt).loss_scalers
    assert [s.get_scale() for s in scalers] == [2.0**16, 2.0**15]
    assert amp.state_of(opt).skipped_steps == 1
    err = rel_err(flat(amp.parameters(opt)) - w0, flat(ref.parameters()) - w0)
    assert err <= UPDATE_TOL[torch.float16]


def test_scale_loss_misuse() -> None:
    model, opt, _, _ = _decorated(torch.float16, "foreach", num_losses=1)
    x, y = image_data(8)
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match="loss_id 1 out of range"), amp.scale_loss(loss, opt, 1):
        pass
    with (
        pytest.raises(amp.AmpStateError, match="no backward ran inside"),
        amp.scale_loss(loss, opt),
    ):
        pass
    opt.zero_grad()
    nested = pytest.raises(amp.AmpStateError, match="cannot be nested")
    with nested, amp.scale_loss(loss, opt), amp.scale_loss(loss, opt):
        pass
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()  # a plain backward, then scale_loss: mixed modes
    mixed = pytest.raises(amp.AmpStateError, match="use either scale_loss or GradScaler")
    with mixed, amp.scale_loss(loss, opt):
        pass


def test_step_before_backward_finished_is_refused() -> None:
    """A backward that raises half-way leaves the grads in the model: step() must refuse."""

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.decorate(model, opt, dtype=torch.bfloat16)
    # Boom's node is created first, so it has the lowest sequence number and the engine runs
    # it last: the params' grads are accumulated (the hook fires) before it raises.
    boom = Boom.apply(torch.randn(3, 4, requires_grad=True)).sum() * 0
    loss = model(torch.randn(3, 4)).sum() + boom
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert amp.state_of(opt).stage is amp.Stage.GRADS_IN_MODEL
    with pytest.raises(amp.AmpStateError, match="backward pass has not finished"):
        opt.step()
    opt.zero_grad()
    assert amp.state_of(opt).stage is amp.Stage.IDLE
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert amp.state_of(opt).stage is amp.Stage.COPIED_BACK
