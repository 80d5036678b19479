"""aiak.amp O2 under torch.compile: a decorated model traces into one graph with
``fullgraph=True`` (inside and outside the user's autocast), and compiled training matches eager
training step by step (bf16 on CPU, as amp's CPU tests run), checkpoints included."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch._dynamo
from _compile_helpers import BF16, MODELS, build
from torch.nn import functional as F

import aiak.amp as amp


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decorated(name: str):
    model, x, y = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.decorate(model, opt, dtype=BF16)
    return model, opt, x, y


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("autocast", [False, True])
def test_decorated_model_is_one_graph(name: str, autocast: bool) -> None:
    model, _, x, _ = _decorated(name)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_fullgraph_compile_keeps_autocast_off_inside() -> None:
    """The op CPU autocast would run in fp32 (``prod``) stays bf16 inside the compiled model,
    and the user's autocast is on again after it; leaving or entering autocast between calls
    recompiles (dynamo guards on autocast's state), it never runs the other region's graph."""
    model, _, x, _ = _decorated("resnet")
    seen = []
    model.head.register_forward_hook(lambda m, a, out: seen.append(out.prod(-1).dtype))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x)  # compiled outside autocast first: the autocast state is guarded on
    with torch.autocast("cpu", dtype=BF16):
        out = compiled(x)
        assert torch.is_autocast_enabled("cpu")
    compiled(x)
    assert not torch.is_autocast_enabled("cpu")
    assert seen == [BF16, BF16, BF16]
    assert out.dtype == torch.float32


def _step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("name", MODELS)
def test_compiled_training_matches_eager(name: str) -> None:
    """Same losses, grads and fp32 masters after each step, compiled (aot_eager: the graph
    autograd and the decorated forward produce, run by eager kernels) vs eager."""
    model, x, y = build(name)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    amp.decorate(model, opt, dtype=BF16)
    amp.decorate(twin, opt_c, dtype=BF16)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        loss = _step(model, opt, x, y)
        loss_c = _step(compiled, opt_c, x, y)
        torch.testing.assert_close(loss_c, loss, rtol=1e-2, atol=1e-3)
        for (n, p), p_c in zip(model.named_parameters(), twin.parameters()):
            assert p_c.dtype == p.dtype, n
            torch.testing.assert_close(p_c.grad, p.grad, rtol=2e-2, atol=2e-3, msg=n)
        for m, m_c in zip(amp.parameters(opt), amp.parameters(opt_c)):
            assert m.dtype == torch.float32
            torch.testing.assert_close(m_c, m, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_inductor_compiled_step_matches_eager() -> None:
    """The real compiler (inductor's CPU code) on the conv net with fp32 BatchNorm."""
    model, x, y = build("resnet")
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    amp.decorate(model, opt, dtype=BF16)
    amp.decorate(twin, opt_c, dtype=BF16)
    compiled = torch.compile(twin, fullgraph=True)
    for _ in range(2):
        loss, loss_c = _step(model, opt, x, y), _step(compiled, opt_c, x, y)
        torch.testing.assert_close(loss_c, loss, rtol=2e-2, atol=2e-3)
    for m, m_c in zip(amp.parameters(opt), amp.parameters(opt_c)):
        torch.testing.assert_close(m_c, m, rtol=1e-2, atol=1e-3)


def test_checkpoints_are_the_same_with_and_without_compile() -> None:
    """The decorated model's state_dict keys and dtypes do not change by compiling it; an eager
    checkpoint (amp.state_dict) resumes a compiled run bit for bit."""
    model, opt, x, y = _decorated("swin")
    keys = {k: v.dtype for k, v in model.state_dict().items()}
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _step(compiled, opt, x, y)
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys
    assert {k.removeprefix("_orig_mod."): v.dtype for k, v in compiled.state_dict().items()} == (
        keys
    )
    ckpt = copy.deepcopy(amp.state_dict(model, opt))

    eager, opt_e, _, _ = _decorated("swin")
    amp.load_state_dict(ckpt, eager, opt_e)
    for _ in range(2):
        loss_c, loss_e = _step(compiled, opt, x, y), _step(eager, opt_e, x, y)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-3)


def test_forward_wrapper_keeps_the_signature_and_the_users_hooks_see_fp32() -> None:
    model, _, x, _ = _decorated("resnet")
    assert list(inspect.signature(model.forward).parameters) == ["x"]
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model(x)
    assert seen == [torch.float32]
    copied = copy.deepcopy(model)  # the wrapper follows the copy, not the original
    assert copied.forward.__wrapped__.__self__ is copied
    torch.testing.assert_close(copied(x), model(x))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("name", ["resnet", "swin_convert"])
def test_fp16_o2_under_inductor_on_cuda(name: str, mode: str | None, cuda_device) -> None:
    """On the GPU: fp16 O2 with aiak's GradScaler, the model compiled by inductor with
    ``fullgraph=True`` (and with CUDA graphs: ``mode="reduce-overhead"`` replays the forward
    and the backward, aiak's window attention kernels included, from captured graphs), against
    the same O2 run eager."""
    model, x, y = build(name)
    model, x, y = model.to(cuda_device), x.to(cuda_device), y.to(cuda_device)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    amp.decorate(model, opt)
    amp.decorate(twin, opt_c)
    compiled = torch.compile(twin, fullgraph=True, mode=mode)
    scalers = amp.GradScaler("cuda"), amp.GradScaler("cuda")
    for _ in range(4):  # CUDA graphs: recorded on the 2nd call, replayed from the 3rd
        losses = []
        for m, o, s in ((model, opt, scalers[0]), (compiled, opt_c, scalers[1])):
            o.zero_grad()
            with torch.autocast("cuda"):
                loss = F.cross_entropy(m(x), y)
            s.scale(loss).backward()
            s.step(o)
            s.update()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=1e-3)
    for m, m_c in zip(amp.parameters(opt), amp.parameters(opt_c)):
        torch.testing.assert_close(m_c, m, rtol=1e-2, atol=1e-3)
