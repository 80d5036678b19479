"""aiak::fused_adam_: opcheck, the reference's GradScaler skip, torch.compile; on CUDA the kernel
against the reference for every dtype (mixed in one list), with GradScaler's unscale/skip and
amp copy-back."""

from __future__ import annotations

import pytest
import torch
from _fused_args import DTYPES, assert_same, clone
from _fused_args import adam as make_args

import aiak.ops

OP = aiak.ops.fused_adam_
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def test_opcheck() -> None:
    a = make_args(grad_scale=torch.tensor([2.0]), found_inf=torch.zeros(1))
    torch.library.opcheck(OP.overload, tuple(a))


def test_skipped_step_writes_nothing() -> None:
    a = make_args(grad_scale=torch.tensor([2.0]), found_inf=torch.ones(1))
    before = clone(a)
    OP(*a)
    assert_same(a, before, {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0})


def test_compiles_with_torch_compile() -> None:
    a = make_args(dtypes=(torch.float32,))
    ref = clone(a)
    OP(*ref)
    torch.compile(OP.overload, backend="aot_eager", fullgraph=True)(*a)
    assert_same(a, ref, {torch.float32: 1e-6})


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_kernel_matches_reference(amp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {}
    if amp:
        extra = {
            "grad_scale": torch.tensor([4.0], device="cuda"),
            "found_inf": torch.zeros(1, device="cuda"),
        }
    a = make_args("cuda", DTYPES, **extra)
    if amp:  # copy-back into half copies of every other param
        copy_to = [
            p.half() if i % 2 else torch.empty(0, device="cuda") for i, p in enumerate(a.params)
        ]
        a = a._replace(copy_to=copy_to)
    ref = clone(a)
    for _ in range(3):
        OP(*a)
        with monkeypatch.context() as m, pytest.warns(RuntimeWarning, match="reference"):
            m.setenv("AIAK_DISABLE_KERNELS", "1")
            aiak.ops._capability.clear_warnings()
            OP(*ref)
    torch.cuda.synchronize()
    assert_same(a, ref, TOL)


@pytest.mark.cuda
def test_cuda_skip_on_device_without_host_sync() -> None:
    a = make_args(
        "cuda",
        DTYPES,
        grad_scale=torch.tensor([2.0], device="cuda"),
        found_inf=torch.zeros(1, device="cuda"),
    )
    OP(*a)  # tables, compilation
    a = a._replace(found_inf=torch.ones(1, device="cuda"))
    before = clone(a)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        OP(*a)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_same(a, before, {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0})


# --------------------------------------------------------------------------------------------
# The bound step's host logic (ops._fused.Bound), on CPU: the CUDA branch is taken for CPU
# tensors and its "launch" runs the reference, recording which device table it was given.
# --------------------------------------------------------------------------------------------


def _bound_on_cpu(monkeypatch: pytest.MonkeyPatch, params, rest, conform=None):
    import dataclasses

    from aiak.ops import _capability, _fused, _mta
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
        _, numels, _, _ = _mta.key("", lists)
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
