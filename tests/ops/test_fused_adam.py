"""aiak::fused_adam_: the fused optimizer cases of ``_fused_cases`` run on Adam, and the bound
step's host logic (``ops._fused.Bound``) on CPU."""

from __future__ import annotations

import pytest
import torch
from _fused_args import adam as make_args
from _fused_args import assert_same, clone
from _fused_cases import *  # noqa: F403  (the shared tests, collected here with ``fused``)
from _fused_cases import Fused

import aiak.ops

OP = aiak.ops.fused_adam_


@pytest.fixture
def fused() -> Fused:
    return Fused(OP, make_args)


# --------------------------------------------------------------------------------------------
# The bound step's host logic (ops._fused.Bound), on CPU: the CUDA branch is taken for CPU
# tensors and its "launch" runs the reference, recording which device table it was given.
# --------------------------------------------------------------------------------------------


def _bound_on_cpu(monkeypatch: pytest.MonkeyPatch, params, rest, conform=None):
    import dataclasses

    from aiak.ops import _capability, _fused, _host, _mta
    from aiak.ops import fused_adam as module
    from aiak.ops._registry import Op

    class CpuAsCuda(Op):
        def eager_kernel(self, args):
            return self.cuda

    op = CpuAsCuda(**{f.name: getattr(OP, f.name) for f in dataclasses.fields(Op)})
    tables = []

    def launch(a, tab):
        tables.append(tab)
        module._reference(a)

    def build(lists, device):
        numels, _, _ = _host.parts(lists)
        data = torch.zeros(1, dtype=torch.int64)
        return _mta.Table(data, len(lists), len(numels[0]), 1, None, 0, frozenset())

    monkeypatch.setattr(_capability.Capability, "not_supported_reasons", lambda *a, **k: [])
    monkeypatch.setattr(_mta, "build", build)
    monkeypatch.setattr(_mta.Table, "wait", lambda self: None)
    kernel = dataclasses.replace(
        module.KERNEL, cap=_capability.Capability("test_bound_adam"), launch=launch
    )
    monkeypatch.setitem(_fused.KERNELS, "fused_adam_", module.KERNEL)  # restored after
    return _fused.Bound(op, kernel, params, rest, conform or (lambda g: g)), tables


def test_bound_step_keeps_its_table_while_nothing_moves(monkeypatch) -> None:
    a = make_args(dtypes=(torch.float32,))
    ref = clone(a)
    rest = [a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs, a.state_steps, a.copy_to]
    bound, tables = _bound_on_cpu(monkeypatch, a.params, rest)
    scalars = tuple(a)[7:]
    grads = a.grads

    def step(g):
        bound(g, *scalars)
        OP(ref.params, [x.clone() for x in g], *tuple(ref)[2:])

    step(grads)  # first call: checked, table built
    step(grads)  # same grads: the kept table, no lookup
    assert len(tables) == 2 and tables[1] is tables[0]
    for g in grads:
        g.mul_(0.5)  # new values, same memory (zero_grad(set_to_none=False) + backward)
    step(grads)
    assert tables[2] is tables[0]
    moved = [g.clone() for g in grads]  # new grads elsewhere (set_to_none + backward)
    step(moved)
    assert tables[3] is not tables[0]
    a.params[1].data = a.params[1].detach().clone()  # a param's storage replaced
    ref.params[1].data = ref.params[1].detach().clone()
    step(moved)
    assert tables[4] is not tables[3]
    assert_same(a._replace(grads=[]), ref._replace(grads=[]), {torch.float32: 1e-6})


def test_bound_step_conforms_grads_of_another_layout(monkeypatch) -> None:
    p = torch.randn(4, 3)
    state = [[torch.zeros(4, 3)], [torch.zeros(4, 3)], [], [torch.zeros(())], []]
    seen = []

    def conform(grads):
        seen.append(True)
        return [g.contiguous() for g in grads]

    bound, tables = _bound_on_cpu(monkeypatch, [p], state, conform)
    scalars = (1e-2, None, 0.9, 0.99, 1e-8, 0.0, True, False, False, True, None, None)
    g = torch.randn(3, 4).t()  # transposed: not the param's layout
    bound([g], *scalars)
    assert seen and len(tables) == 1
    bound([g], *scalars)  # the fast path refuses it (layout), conform runs again
    assert len(seen) == 2
