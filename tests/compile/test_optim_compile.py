"""aiak.optim with torch.compile: the fused optimizers (and ``fuse``) step a compiled model and
give torch's optimizer's results; a compiled training step that calls ``opt.step()`` traces the
step into a graph of its own (dynamo breaks only at ``loss.backward()``) and gives the eager
step's parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from _compile_helpers import BF16, build
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp
from aiak.optim import LARS, FusedAdam, FusedAdamW, FusedLAMB, FusedSGD, fuse


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# (aiak optimizer, torch optimizer with the same maths)
PAIRS = {
    "FusedAdam": (
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    ),
    "FusedAdamW": (
        lambda p: FusedAdamW(p, lr=1e-2, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    ),
    "FusedSGD": (
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    ),
    "fuse(SGD)": (
        lambda p: fuse(torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    ),
    "fuse(AdamW)": (
        lambda p: fuse(torch.optim.AdamW(p, lr=1e-2)),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
    ),
}


def _train(model, opt, x, y, steps: int, autocast: bool = False) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("name", PAIRS)
def test_fused_optimizer_steps_a_compiled_model_as_torch_does(name: str) -> None:
    make_aiak, make_torch = PAIRS[name]
    model, x, y = build("resnet")
    twin = copy.deepcopy(model)
    opt, ref_opt = make_aiak(model.parameters()), make_torch(twin.parameters())
    assert type(opt).__module__.startswith("aiak.optim")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ref = torch.compile(twin, fullgraph=True, backend="aot_eager")
    losses, ref_losses = _train(compiled, opt, x, y, 4), _train(ref, ref_opt, x, y, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
    assert len(opt.state) == len(ref_opt.state) > 0


def test_fused_adamw_with_o2_and_a_compiled_model() -> None:
    """FusedAdamW writes the half weights itself (amp's copy-back protocol) while the model is
    compiled: the same masters and half weights as torch's AdamW under the same O2."""
    model, x, y = build("swin")
    twin = copy.deepcopy(model)
    opt, ref_opt = FusedAdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(twin.parameters())
    ref_opt.param_groups[0]["lr"] = 1e-3
    amp.decorate(model, opt, dtype=BF16)
    amp.decorate(twin, ref_opt, dtype=BF16)
    assert getattr(opt, "_aiak_copy_back", None)  # the fused path is the one under test
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ref = torch.compile(twin, fullgraph=True, backend="aot_eager")
    _train(compiled, opt, x, y, 3, autocast=True)
    _train(ref, ref_opt, x, y, 3, autocast=True)
    for m, r in zip(amp.parameters(opt), amp.parameters(ref_opt)):
        torch.testing.assert_close(m, r, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p, q, rtol=0, atol=0)


STEP_OPTIMIZERS = {
    "FusedAdamW": lambda p: FusedAdamW(p, lr=1e-2, weight_decay=0.01),
    "FusedSGD": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
    "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-2),
    "LARS": lambda p: LARS(p, lr=0.1, momentum=0.9),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("name", STEP_OPTIMIZERS)
def test_compiled_training_step_traces_the_optimizer_step(name: str) -> None:
    """``torch.compile`` of ``zero_grad; forward; backward; opt.step()``: dynamo breaks at
    ``loss.backward()`` only, the step after it is traced (``torch.ops.aiak.fused_*`` as one
    node), and the parameters are the eager step's after several steps (no recompilation per
    step)."""
    make = STEP_OPTIMIZERS[name]
    model = _mlp()
    twin = copy.deepcopy(model)
    opt, opt_c = make(model.parameters()), make(twin.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

    def step_fn(m: nn.Module, o: torch.optim.Optimizer):
        def step() -> torch.Tensor:
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss.detach()

        return step

    eager, step_c = step_fn(model, opt), step_fn(twin, opt_c)
    eager()
    step_c()  # eager too: the state exists before tracing (as after any first step)
    explained = torch._dynamo.explain(step_c)()
    torch._dynamo.reset()
    reasons = [b.reason for b in explained.break_reasons]
    assert reasons and all("backward" in r for r in reasons), reasons
    # after the backward: the update is one call of aiak's op (its reference kernel on CPU)
    ops = [
        str(n.target)
        for gm in explained.graphs[1:]
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]
    assert [op for op in ops if op.startswith("aiak.")], ops

    eager()  # the explain run stepped twin once more: bring model level
    frames: list[int] = []

    def count(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        frames.append(1)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(step_c, backend=count)
    for _ in range(4):
        torch.testing.assert_close(compiled(), eager(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert len(frames) <= 4, "recompiled per step"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["FusedAdamW", "FusedSGD", "FusedLAMB"])
def test_compiled_step_on_cuda_calls_the_fused_op(name: str, cuda_device) -> None:
    """On CUDA the step is ``torch.ops.aiak.fused_*`` (custom ops with fakes): inductor
    compiles a step that calls it and gives the eager step's parameters."""
    make = STEP_OPTIMIZERS[name]
    model = _mlp().to(cuda_device)
    twin = copy.deepcopy(model)
    opt, opt_c = make(model.parameters()), make(twin.parameters())
    x = torch.randn(4, 8, device=cuda_device)
    y = torch.randn(4, 2, device=cuda_device)

    def step_fn(m, o):
        def step():
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss.detach()

        return step

    eager, compiled = step_fn(model, opt), torch.compile(step_fn(twin, opt_c))
    for _ in range(4):
        torch.testing.assert_close(compiled(), eager(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    explained = torch._dynamo.explain(step_fn(twin, opt_c))()
    ops = {
        str(n.target) for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"
    }
    assert any("aiak" in op for op in ops), sorted(ops)
