"""DGCSGD's foreach step against its per-tensor rule: ``p -= lr * (g + w)``, ``w`` the weight
decay term with momentum (``buf = m * buf + wd * p``, the first step ``buf = wd * p``;
nesterov ``w = wd * p + m * buf``), over groups that mix dtypes and hold parameters with no
gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak import comm


def _reference_step(params: list[torch.Tensor], bufs: dict, lr, m, wd, nesterov) -> None:
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        d = p.grad
        if wd:
            w = p.mul(wd)
            if m:
                if i not in bufs:
                    bufs[i] = w.clone()
                else:
                    bufs[i].mul_(m).add_(w)
                w = w.add(bufs[i], alpha=m) if nesterov else bufs[i]
            d = d.add(w)
        p.add_(d, alpha=-lr)


@settings(max_examples=40, deadline=None)
@given(
    lr=st.sampled_from([0.0, 0.1, 1e-3]),
    m=st.sampled_from([0.0, 0.9]),
    wd=st.sampled_from([0.0, 1e-2]),
    nesterov=st.booleans(),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    doubles=st.lists(st.booleans(), min_size=6, max_size=6),
    no_grad=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_foreach_step_is_the_per_tensor_rule(lr, m, wd, nesterov, sizes, doubles, no_grad):
    gen = torch.Generator().manual_seed(len(sizes))
    dtypes = [torch.float64 if d else torch.float32 for d in doubles]
    params = [torch.randn(n, generator=gen, dtype=dt) for n, dt in zip(sizes, dtypes)]
    ref = [p.clone() for p in params]
    opt = comm.DGCSGD(params, lr=lr, momentum=m, weight_decay=wd, nesterov=nesterov)
    bufs: dict = {}
    for _ in range(3):
        for i, (p, q) in enumerate(zip(params, ref)):
            g = None if no_grad[i] else torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad, q.grad = g, None if g is None else g.clone()
        opt.step()
        _reference_step(ref, bufs, lr, m, wd, nesterov)
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    for i, p in enumerate(params):
        st_ = opt.state.get(p, {})
        if i in bufs:
            torch.testing.assert_close(st_["momentum_buffer"], bufs[i], rtol=0, atol=0)
        else:
            assert "momentum_buffer" not in st_


def test_one_group_of_many_tensors_takes_a_constant_number_of_calls() -> None:
    """The step's torch calls do not grow with the number of tensors (no per-tensor launch)."""
    from torch.profiler import ProfilerActivity, profile

    def calls(n: int) -> int:
        params = [torch.zeros(3, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.ones(3)
        opt = comm.DGCSGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)
        opt.step()  # the first step creates the buffers
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        return sum(1 for e in prof.events() if e.name.startswith("aten::_foreach"))

    assert calls(4) == calls(64) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("nesterov", [False, True])
def test_foreach_step_on_cuda_is_the_per_tensor_rule(nesterov: bool, cuda_device) -> None:
    """On the GPU torch's foreach kernels (its fast path) run the step; the per-tensor rule with
    torch's own ops on the same device is the reference."""
    gen = torch.Generator().manual_seed(0)
    shapes, dtypes = [(64, 3, 7, 7), (64,), (1000, 2048), (1,)], [torch.float32, torch.float16]
    params = [torch.randn(s, generator=gen).to(cuda_device, dt) for s in shapes for dt in dtypes]
    ref = [p.clone() for p in params]
    opt = comm.DGCSGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=nesterov)
    bufs: dict = {}
    for _ in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=gen).to(cuda_device, p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        _reference_step(ref, bufs, 0.1, 0.9, 1e-2, nesterov)
    for p, q in zip(params, ref):
        tol = 1e-6 if p.dtype == torch.float32 else 1e-3
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
