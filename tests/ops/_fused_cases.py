"""The tests every fused optimizer op shares: opcheck, the reference's GradScaler skip,
torch.compile; on CUDA the kernel against the reference for every dtype (mixed in one list),
with GradScaler's unscale/skip and amp copy-back.

Each ``test_fused_<op>.py`` star-imports the tests named in ``__all__`` (pytest collects them
there, under that file's name) and defines the ``fused`` fixture: the op and the builder of its
argument record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from _fused_args import DTYPES, assert_same, clone

import aiak.ops

__all__ = [
    "test_compiles_with_torch_compile",
    "test_cuda_kernel_matches_reference",
    "test_cuda_skip_on_device_without_host_sync",
    "test_opcheck",
    "test_skipped_step_writes_nothing",
]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EXACT = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0}


class Fused(NamedTuple):
    op: Any
    make_args: Callable[..., Any]


def test_opcheck(fused: Fused) -> None:
    a = fused.make_args(grad_scale=torch.tensor([2.0]), found_inf=torch.zeros(1))
    torch.library.opcheck(fused.op.overload, tuple(a))


def test_skipped_step_writes_nothing(fused: Fused) -> None:
    a = fused.make_args(grad_scale=torch.tensor([2.0]), found_inf=torch.ones(1))
    before = clone(a)
    fused.op(*a)
    assert_same(a, before, EXACT)


def test_compiles_with_torch_compile(fused: Fused) -> None:
    a = fused.make_args(dtypes=(torch.float32,))
    ref = clone(a)
    fused.op(*ref)
    torch.compile(fused.op.overload, backend="aot_eager", fullgraph=True)(*a)
    assert_same(a, ref, {torch.float32: 1e-6})


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_kernel_matches_reference(
    fused: Fused, amp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {}
    if amp:
        extra = {
            "grad_scale": torch.tensor([4.0], device="cuda"),
            "found_inf": torch.zeros(1, device="cuda"),
        }
    a = fused.make_args("cuda", DTYPES, **extra)
    if amp:  # copy-back into half copies of every other param
        copy_to = [
            p.half() if i % 2 else torch.empty(0, device="cuda") for i, p in enumerate(a.params)
        ]
        a = a._replace(copy_to=copy_to)
    ref = clone(a)
    for _ in range(3):
        fused.op(*a)
        with monkeypatch.context() as m, pytest.warns(RuntimeWarning, match="reference"):
            m.setenv("AIAK_DISABLE_KERNELS", "1")
            aiak.ops._capability.clear_warnings()
            fused.op(*ref)
    torch.cuda.synchronize()
    assert_same(a, ref, TOL)


@pytest.mark.cuda
def test_cuda_skip_on_device_without_host_sync(fused: Fused) -> None:
    a = fused.make_args(
        "cuda",
        DTYPES,
        grad_scale=torch.tensor([2.0], device="cuda"),
        found_inf=torch.zeros(1, device="cuda"),
    )
    fused.op(*a)  # tables, compilation
    a = a._replace(found_inf=torch.ones(1, device="cuda"))
    before = clone(a)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused.op(*a)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_same(a, before, EXACT)
