"""``aiak.ops.swin.convert`` under torch.compile: inside a compiled graph a converted block keeps
the fused attention op but partitions and merges its windows with timm's roll + view/permute,
which inductor fuses into the kernels around it (LayerNorm, the residual add); eager keeps the
gather ops. Same numbers either way (research/compile_window_attention.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from _compile_helpers import build
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _AiakCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aiak":
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _aiak_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target).split(".")[1]
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("aiak.")
    ]


def test_compiled_graph_keeps_the_attention_op_and_timms_partition() -> None:
    model, x, _ = build("swin_convert")
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}

    def grab(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            graphs[kind].append(gm)
            return gm.forward

        return compiler

    from functorch.compile import make_boxed_func

    backend = aot_autograd(
        fw_compiler=lambda gm, ex: make_boxed_func(grab("fw")(gm, ex)),
        bw_compiler=lambda gm, ex: make_boxed_func(grab("bw")(gm, ex)),
    )
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(x).sum().backward()
    fw, bw = _aiak_ops(graphs["fw"][0]), _aiak_ops(graphs["bw"][0])
    assert fw == ["window_attention", "window_attention"], fw
    assert bw == ["window_attention_backward", "window_attention_backward"], bw
    # timm's shifted block rolls in the graph instead
    assert any(n.target == torch.ops.aten.roll.default for n in graphs["fw"][0].graph.nodes)


def test_eager_still_runs_the_gather_ops() -> None:
    model, x, _ = build("swin_convert")
    with _AiakCalls() as calls:
        model(x)
    assert calls.ops.count("roll_window_partition") == 2
    assert calls.ops.count("window_merge_roll") == 2
    assert calls.ops.count("window_attention") == 2


def test_compiled_converted_model_matches_eager() -> None:
    model, x, y = build("swin_convert")
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss_c = torch.nn.functional.cross_entropy(compiled(x), y)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    loss_c.backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
