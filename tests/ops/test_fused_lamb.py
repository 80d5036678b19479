"""aiak::fused_lamb_: opcheck, the reference's GradScaler skip, torch.compile; on CUDA the kernel
against the reference for every dtype (mixed in one list), with GradScaler's unscale/skip and
amp copy-back."""

from __future__ import annotations

import pytest
import torch
from _fused_args import DTYPES, assert_same, clone
from _fused_args import lamb as make_args

import aiak.ops

OP = aiak.ops.fused_lamb_
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
