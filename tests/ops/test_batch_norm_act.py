"""aiak::batch_norm_act: against torch's batch norm + add + ReLU (values, gradients, running
statistics), errors, opcheck, torch.compile, and the CUDA kernels against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from aiak.ops.batch_norm_act import batch_norm_act


def _torch(x, rm, rv, w, b, training, momentum, eps, residual, relu):
    y = F.batch_norm(x, rm, rv, w, b, training, momentum, eps)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if relu else y


def _inputs(shape, dtype=torch.float64, device="cpu", affine=True, residual=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5
    x = x.to(device, dtype)
    if len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(device) if affine else None
    b = torch.randn(c, generator=g, dtype=torch.float64).to(device) if affine else None
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype) if residual else None
    if r is not None and len(shape) == 4:
        r = r.contiguous(memory_format=torch.channels_last)
    return x, w, b, r


def _grads(out, tensors, grad):
    tensors = [t for t in tensors if t is not None]
    return torch.autograd.grad(out, tensors, grad)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(4, 3, 5, 2), (2, 8, 3, 3), (7, 5), (3, 4, 6), (2, 1, 2, 2), (2, 16)]),
    relu=st.booleans(),
    residual=st.booleans(),
    affine=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_reference_matches_torch_values_grads_and_running_stats(
    shape, relu, residual, affine, seed
) -> None:
    x, w, b, r = _inputs(shape, affine=affine, residual=residual, seed=seed)
    leaves = [t.requires_grad_() for t in (x, w, b, r) if t is not None]
    c = shape[1]
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    rm2, rv2 = rm.clone(), rv.clone()
    y = batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, r, relu)
    ref = _torch(x, rm2, rv2, w, b, True, 0.1, 1e-5, r, relu)
    torch.testing.assert_close(y, ref)
    grad = torch.randn_like(y)
    for got, want in zip(_grads(y, leaves, grad), _grads(ref, leaves, grad)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(rm, rm2)
    torch.testing.assert_close(rv, rv2)


def test_eval_mode_uses_running_stats_and_matches_torch() -> None:
    x, w, b, r = _inputs((4, 6, 3, 3))
    rm, rv = torch.randn(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64) + 0.5
    before = rm.clone(), rv.clone()
    y = batch_norm_act(x, rm, rv, w, b, False, 0.1, 1e-5, r, True)
    torch.testing.assert_close(y, _torch(x, rm, rv, w, b, False, 0.1, 1e-5, r, True))
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


def test_half_input_with_fp32_weight_computes_in_fp32_and_rounds_once() -> None:
    x, w, b, r = _inputs((8, 16, 4, 4), dtype=torch.bfloat16)
    w, b = w.float(), b.float()
    y = batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, r, True)
    exact = _torch(
        x.double(), None, None, w.double(), b.double(), True, 0.1, 1e-5, r.double(), True
    )
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, exact.to(torch.bfloat16), rtol=0, atol=0)


def test_op_gradcheck_and_opcheck() -> None:
    x, w, b, r = _inputs((3, 4, 2, 2))
    args = [t.requires_grad_() for t in (x, w, b, r)]
    op = torch.ops.aiak.batch_norm_act

    def fn(x, w, b, r):
        return op(x, w, b, r, 1e-5, False)[0]

    assert torch.autograd.gradcheck(fn, args)
    for relu in (True, False):
        torch.library.opcheck(
            op, (*(a.detach().float().requires_grad_() for a in args), 1e-5, relu)
        )
    dy = torch.randn(3, 4, 2, 2)
    y, mean, invstd = op(*(a.detach() for a in args), 1e-5, True)
    torch.library.opcheck(
        torch.ops.aiak.batch_norm_act_backward,
        (dy, x.detach(), y, w.detach(), b.detach(), mean, invstd, True, True),
    )


def test_compiles_fullgraph_and_matches_eager() -> None:
    def step(x, rm, rv, w, b, r):
        return batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, r, True)

    x, w, b, r = _inputs((8, 16, 4, 4), dtype=torch.float32)
    w, b = w.float().requires_grad_(), b.float().requires_grad_()
    x.requires_grad_()
    stats = [torch.zeros(16), torch.ones(16)]
    stats2 = [s.clone() for s in stats]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    y1 = compiled(x, *stats, w, b, r)
    y2 = step(x, *stats2, w, b, r)
    torch.testing.assert_close(y1, y2)
    grad = torch.randn_like(y1)
    for g1, g2 in zip(_grads(y1, [x, w, b], grad), _grads(y2, [x, w, b], grad)):
        torch.testing.assert_close(g1, g2)
    torch.testing.assert_close(stats, stats2)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"input": [1.0]}, TypeError, "input must be a Tensor"),
        ({"input": torch.randn(4)}, ValueError, r"input must be \[N, C, \*\]"),
        ({"input": torch.ones(4, 3, dtype=torch.int64)}, TypeError, "float tensor"),
        ({"weight": torch.ones(4)}, ValueError, r"weight must be \[C\] = \[3\]"),
        ({"bias": "b"}, TypeError, "bias must be a Tensor or None"),
        ({"residual": torch.ones(4, 4)}, ValueError, "residual must match input"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"relu": 1}, TypeError, "relu must be a bool"),
        ({"training": "yes"}, TypeError, "training must be a bool"),
        ({"input": torch.randn(1, 3)}, ValueError, "more than 1 value per channel"),
        ({"running_mean": torch.zeros(5)}, ValueError, "running_mean must be None or a"),
        ({"running_var": None}, ValueError, "must both be None or both given"),
        ({"running_var": torch.ones(3).half()}, TypeError, "float tensors of one dtype"),
        ({"momentum": float("inf")}, ValueError, "momentum"),
    ],
)
def test_bad_input_names_the_argument(kwargs, err, match) -> None:
    args = {
        "input": torch.randn(4, 3),
        "running_mean": torch.zeros(3),
        "running_var": torch.ones(3),
        "weight": torch.ones(3),
        "bias": torch.zeros(3),
        "training": True,
        "momentum": 0.1,
        "eps": 1e-5,
        "residual": None,
        "relu": True,
    }
    args.update(kwargs)
    with pytest.raises(err, match=match):
        batch_norm_act(**args)


@pytest.mark.parametrize(("affine", "bias_only"), [(True, True), (False, False)])
def test_bias_without_weight_and_no_affine_get_their_gradients(affine, bias_only) -> None:
    x, w, b, r = _inputs((4, 6, 3, 3), affine=affine)
    if bias_only:
        w = None
    leaves = [t.requires_grad_() for t in (x, w, b, r) if t is not None]
    y = batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, r, True)
    ref = _torch(x, None, None, w, b, True, 0.1, 1e-5, r, True)
    grad = torch.randn_like(y)
    for got, want in zip(_grads(y, leaves, grad), _grads(ref, leaves, grad)):
        torch.testing.assert_close(got, want)


def test_relu_passes_the_gradient_of_a_nan_output_as_torch_does() -> None:
    x, w, b, _ = _inputs((4, 3, 2, 2), residual=False)
    x = x.detach().clone()
    x[0, 0, 0, 0] = float("nan")  # channel 0's statistics, and so its outputs, are NaN
    leaves = [t.requires_grad_() for t in (x, w, b)]
    y = batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, None, True)
    ref = _torch(x, None, None, w, b, True, 0.1, 1e-5, None, True)
    torch.testing.assert_close(y, ref, equal_nan=True)
    grad = torch.ones_like(y)
    for got, want in zip(_grads(y, leaves, grad), _grads(ref, leaves, grad)):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_weight_and_bias_dtypes_must_agree() -> None:
    with pytest.raises(TypeError, match=r"weight is torch\.float32 but bias is torch\.float64"):
        batch_norm_act(torch.randn(4, 3), None, None, torch.ones(3), torch.zeros(3).double(), True)


# --------------------------------------------------------------------------------------------
# CUDA kernels
# --------------------------------------------------------------------------------------------

cuda = pytest.mark.cuda
CUDA_SHAPES = [
    (16, 64, 8, 8),  # the 8-channel vector path, one slice
    (4, 2048, 3, 3),  # many slices
    (2, 24, 5, 5),  # 3 vectors: a slice narrower than 8 vectors
    (3, 7, 5, 3),  # odd C: the scalar path
    (2, 1, 1, 2),  # C = 1, two values
    (300, 40),  # 2-D
    (64, 256, 28, 28),  # a ResNet-50 layer, many rows per block
]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_cuda(shape, dtype, relu, residual, affine=True, wdtype=torch.float32, offset=False):
    x, w, b, r = _inputs(shape, dtype, "cuda", affine, residual, seed=sum(shape))
    if offset:  # 2-byte aligned views: the scalar path
        x = _shifted(x)
        r = _shifted(r) if r is not None else None
    w = w.to(wdtype) if w is not None else None
    b = b.to(wdtype) if b is not None else None
    leaves = [t.requires_grad_() for t in (x, w, b, r) if t is not None]
    c = shape[1]
    rm, rv = torch.zeros(c, device="cuda", dtype=wdtype), torch.ones(c, device="cuda", dtype=wdtype)
    rm64, rv64 = rm.double(), rv.double()
    y = batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, r, relu)
    exact_in = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(exact_in)
    xe = next(it)
    we = next(it) if w is not None else None
    be = next(it) if b is not None else None
    re_ = next(it) if r is not None else None
    ye = _torch(xe, rm64, rv64, we, be, True, 0.1, 1e-5, re_, relu)
    tol = TOL[dtype]
    assert y.dtype == dtype and y.stride() == x.stride()
    assert _rel(y, ye) <= tol
    grad = torch.randn(shape, device="cuda", dtype=torch.float64).to(dtype)
    grad = grad.contiguous(memory_format=torch.channels_last) if len(shape) == 4 else grad
    for got, want in zip(_grads(y, leaves, grad), _grads(ye, exact_in, grad.double())):
        assert got.dtype == want.dtype or got.dtype in (dtype, wdtype)
        assert _rel(got, want) <= max(tol, 1e-4 if wdtype != torch.float32 else tol), got.shape
    assert _rel(rm, rm64) <= max(tol, 1e-3) and _rel(rv, rv64) <= max(tol, 1e-3)


def _shifted(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.movedim(1, -1).shape).movedim(-1, 1)
    view.copy_(t)
    return view


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize(("relu", "residual"), [(True, True), (True, False), (False, True)])
def test_cuda_kernels_match_float64(dtype, shape, relu, residual) -> None:
    _check_cuda(shape, dtype, relu, residual)


@cuda
@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16])
def test_cuda_half_weights_and_no_affine(wdtype) -> None:
    _check_cuda((8, 32, 4, 4), torch.float16, True, True, wdtype=wdtype)
    _check_cuda((8, 32, 4, 4), torch.float16, True, True, affine=False)


@cuda
def test_cuda_unaligned_views_take_the_scalar_path() -> None:
    _check_cuda((4, 16, 3, 3), torch.float16, True, True, offset=True)


@cuda
def test_cuda_large_mean_does_not_cancel() -> None:
    # |mean| / std = 1e3: E[x^2] - E[x]^2 in fp32 would lose every digit of the variance. What
    # is left is fp32's own: the mean rounds to ulp(1000) / 2 = 3e-5, as torch's fp32 does.
    x = (torch.randn(64, 32, 8, 8, device="cuda", dtype=torch.float64) + 1000).float()
    x = x.contiguous(memory_format=torch.channels_last)
    y = batch_norm_act(x, None, None, None, None, True, 0.1, 1e-5, None, False)
    exact = F.batch_norm(x.double(), None, None, training=True)
    theirs = _rel(F.batch_norm(x, None, None, training=True), exact)
    assert _rel(y, exact) <= max(2 * theirs, 1e-4)


@cuda
def test_cuda_eager_path_and_op_path_give_the_same_numbers() -> None:
    x, w, b, r = _inputs((16, 64, 6, 6), torch.float16, "cuda")
    w, b = w.float(), b.float()
    y_eager = batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, r, True)
    y_op, _, _ = torch.ops.aiak.batch_norm_act(x, w, b, r, 1e-5, True)
    assert torch.equal(y_eager, y_op)


@cuda
def test_cuda_nchw_input_falls_back_to_the_reference_with_a_warning() -> None:
    from aiak.ops._capability import clear_warnings

    clear_warnings()
    x = torch.randn(4, 8, 3, 3, device="cuda")  # NCHW-contiguous
    with pytest.warns(RuntimeWarning, match="channels are not innermost"):
        y = batch_norm_act(x, None, None, None, None, True, 0.1, 1e-5, None, True)
    assert _rel(y, torch.relu(F.batch_norm(x.double(), None, None, training=True))) <= 1e-5


@cuda
def test_cuda_graph_replays_match_eager() -> None:
    x, w, b, r = _inputs((32, 64, 8, 8), torch.float16, "cuda")
    w, b = w.float(), b.float()
    static = x.clone()
    want = batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, r, True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        batch_norm_act(static, None, None, w, b, True, 0.1, 1e-5, r, True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batch_norm_act(static, None, None, w, b, True, 0.1, 1e-5, r, True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    static.mul_(2)  # new data, same graph: the statistics follow it
    graph.replay()
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


@cuda
def test_cuda_repeated_calls_are_bitwise_repeatable() -> None:
    x, w, b, r = _inputs((32, 128, 14, 14), torch.float16, "cuda")
    x.requires_grad_()
    outs = []
    for _ in range(3):
        y = batch_norm_act(x, None, None, w.float(), b.float(), True, 0.1, 1e-5, r, True)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        outs.append((y, gx))
    for y, gx in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(gx, outs[0][1])
