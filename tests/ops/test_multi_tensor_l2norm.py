"""aiak::multi_tensor_l2norm: reference, errors, CUDA; and what the two multi-tensor ops share
(their input errors, opcheck, torch.compile, graph capture, the table cache)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _numerics import assert_rel
from hypothesis import given
from hypothesis import strategies as st

import aiak.ops
from aiak.ops import _mta
from aiak.ops.multi_tensor_l2norm import BoundNorm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _f64_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().square().sum() for t in tensors])


sizes_st = st.lists(st.integers(0, 70_000), min_size=1, max_size=12)


@given(sizes=sizes_st, dtype=st.sampled_from(DTYPES))
def test_l2norm_matches_float64(sizes: list[int], dtype: torch.dtype) -> None:
    tensors = [torch.randn(n).to(dtype) for n in sizes]
    total, per = aiak.ops.multi_tensor_l2norm(tensors, per_tensor=True)
    sq = _f64_norms(tensors)
    assert total.dtype == per.dtype == torch.float32
    assert total.shape == () and per.shape == (len(sizes),)
    # The reference accumulates in fp32 (torch.linalg.vector_norm): the fp32 reduction bound.
    assert_rel(per, sq.sqrt(), 1e-5)
    assert_rel(total.reshape(1), sq.sum().sqrt().reshape(1), 1e-5)


def test_l2norm_without_per_tensor_and_empty_list() -> None:
    total, per = aiak.ops.multi_tensor_l2norm([torch.ones(4), torch.ones(5)])
    assert per.shape == (0,)
    assert total.item() == pytest.approx(3.0)
    total, per = aiak.ops.multi_tensor_l2norm([], per_tensor=True)
    assert total.item() == 0.0 and per.shape == (0,)


def test_l2norm_propagates_inf_and_nan() -> None:
    t = torch.ones(10)
    t[3] = float("inf")
    total, per = aiak.ops.multi_tensor_l2norm([torch.ones(3), t], per_tensor=True)
    assert math.isinf(total.item()) and math.isinf(per[1].item()) and per[0].item() > 0
    t[4] = float("nan")
    total, _ = aiak.ops.multi_tensor_l2norm([t])
    assert math.isnan(total.item())


def test_l2norm_of_strided_views_is_their_norm() -> None:
    base = torch.randn(10, 6)
    views = [base[:, ::2], base.t(), base[1:, 1:]]
    _, per = aiak.ops.multi_tensor_l2norm(views, per_tensor=True)
    assert_rel(per, torch.stack([v.double().norm() for v in views]), 1e-6)


def test_l2norm_autograd_matches_torch() -> None:
    a = torch.randn(7, dtype=torch.float64).float().requires_grad_()
    b = torch.randn(3, 2).requires_grad_()
    total, per = torch.ops.aiak.multi_tensor_l2norm([a, b], True)
    (2 * total + 3 * per[1]).backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = 2 * torch.cat([a2, b2.flatten()]).norm() + 3 * b2.norm()
    ref.backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def _scale(src, dst, scale=None, found=None):
    scale = torch.ones((), dtype=torch.float32) if scale is None else scale
    found = torch.zeros(1) if found is None else found
    torch.ops.aiak.multi_tensor_scale_(src, dst, scale, found)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: aiak.ops.multi_tensor_l2norm([torch.ones(3, dtype=torch.int64)]),
            TypeError,
            r"tensors\[0\] has dtype int64",
        ),
        (
            lambda: aiak.ops.multi_tensor_l2norm([torch.ones(3), torch.ones(2, device="meta")]),
            ValueError,
            r"tensors\[1\] is on meta",
        ),
        (lambda: aiak.ops.multi_tensor_l2norm([torch.ones(2).to_sparse()]), TypeError, "layout"),
        (lambda: _scale([torch.ones(3)], []), ValueError, "src has 1 tensors but dst has 0"),
        (lambda: _scale([torch.ones(3)], [torch.ones(4)]), ValueError, r"dst\[0\] has 4 elements"),
        (lambda: _scale([torch.ones(2, 6)], [torch.ones(4, 3).t()]), ValueError, "differ in shape"),
        (
            lambda: _scale([torch.ones(4, 3).t()], [torch.ones(4, 3).t().contiguous()]),
            ValueError,
            "same memory layout",
        ),
        (lambda: _scale([torch.ones(6)[::2]], [torch.ones(3)]), ValueError, "dense"),
        (
            lambda: _scale([torch.ones(3)], [torch.ones(3, dtype=torch.int32)]),
            TypeError,
            r"dst\[0\] has dtype int32",
        ),
        (
            lambda: _scale([torch.ones(3)], [torch.ones(3)], scale=torch.ones(2)),
            ValueError,
            "scale must have one element",
        ),
        (
            lambda: _scale([torch.ones(3)], [torch.ones(3)], scale=torch.ones(1).double()),
            TypeError,
            "scale must be torch.float32",
        ),
        (
            lambda: _scale([torch.ones(3)], [torch.ones(3)], found=torch.zeros(1).half()),
            TypeError,
            "found_inf must be torch.float32",
        ),
        (
            lambda: _scale([torch.ones(3)], [torch.ones(3, device="meta")]),
            ValueError,
            "dst is on meta",
        ),
    ],
)
def test_bad_input_names_the_argument(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_opcheck_cpu() -> None:
    ts = [torch.randn(5), torch.randn(3, 4).half(), torch.randn(0)]
    torch.library.opcheck(torch.ops.aiak.multi_tensor_l2norm.default, (ts, True))
    torch.library.opcheck(torch.ops.aiak.multi_tensor_l2norm.default, (ts, False))
    dst = [torch.empty(5), torch.empty(3, 4), torch.empty(0).half()]
    torch.library.opcheck(
        torch.ops.aiak.multi_tensor_scale_.default,
        (ts, dst, torch.tensor(3.0), torch.zeros(1)),
    )


def test_compiles_with_torch_compile() -> None:
    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total, per = torch.ops.aiak.multi_tensor_l2norm([a, b], True)
        return total + per.sum()

    a, b = torch.randn(10), torch.randn(4, 4)
    torch.testing.assert_close(
        f(a, b), a.norm().new_tensor(0) + torch.cat([a, b.flatten()]).norm() + a.norm() + b.norm()
    )


def _cuda_set(sizes: list[int], dtype: torch.dtype, unaligned: bool = False) -> list[torch.Tensor]:
    out = []
    for n in sizes:
        off = 3 if unaligned else 0
        out.append(torch.randn(n + off, device="cuda").to(dtype)[off:])
    return out


EDGE_SIZES = [0, 1, 7, 8, 65535, 65536, 65537, 131075, 1_000_003]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unaligned", [False, True])
def test_cuda_l2norm_matches_float64(dtype: torch.dtype, unaligned: bool) -> None:
    ts = _cuda_set(EDGE_SIZES, dtype, unaligned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel must run, not fall back
        total, per = aiak.ops.multi_tensor_l2norm(ts, per_tensor=True)
    sq = _f64_norms(ts)
    assert per.is_cuda and total.is_cuda
    assert_rel(per, sq.sqrt(), 1e-6)
    assert_rel(total.reshape(1), sq.sum().sqrt().reshape(1), 1e-6)


@pytest.mark.cuda
def test_cuda_l2norm_mixed_dtypes_thousands_and_determinism() -> None:
    ts = [
        torch.randn(int(n), device="cuda").to(DTYPES[i % 3])
        for i, n in enumerate(torch.randint(0, 3000, (3000,)))
    ]
    a = aiak.ops.multi_tensor_l2norm(ts, per_tensor=True)
    b = aiak.ops.multi_tensor_l2norm(ts, per_tensor=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # no atomics: bitwise repeatable
    assert_rel(a[1], _f64_norms(ts).sqrt(), 1e-6)


@pytest.mark.cuda
def test_cuda_one_launch_resets_its_tickets_and_keeps_a_workspace_per_stream() -> None:
    # The last blocks elect themselves with tickets kept in a per-(table, stream) workspace:
    # every call must leave them at zero, and two streams must not share one.
    _mta.clear_cache()
    ts = _cuda_set([70_000, 3, 0, 200_000, 65_536], torch.float32)
    for _ in range(5):
        for t in ts:
            t.normal_()
        total, per = aiak.ops.multi_tensor_l2norm(ts, per_tensor=True)
        sq = _f64_norms(ts)
        assert_rel(per, sq.sqrt(), 1e-6)
        assert_rel(total.reshape(1), sq.sum().sqrt().reshape(1), 1e-6)
    tab = _mta.cached("multi_tensor_l2norm", [ts])
    assert tab is not None and len(tab.scratches) == 1
    tickets = next(iter(tab.scratches.values()))[: 1 + len(ts)]  # the layout in the .cu
    assert not tickets.any()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [aiak.ops.multi_tensor_l2norm(ts)[0] for _ in range(20)]
    mains = [aiak.ops.multi_tensor_l2norm(ts)[0] for _ in range(20)]
    torch.cuda.current_stream().wait_stream(side)
    assert len(tab.scratches) == 2
    assert all(torch.equal(o, mains[0]) for o in outs + mains)  # bitwise, on both streams
    assert_rel(mains[0].reshape(1), _f64_norms(ts).sum().sqrt().reshape(1), 1e-6)


@pytest.mark.cuda
def test_cuda_list_without_elements_runs_one_block() -> None:
    ts = [torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda").half()]
    total, per = aiak.ops.multi_tensor_l2norm(ts, per_tensor=True)
    assert total.item() == 0.0 and per.tolist() == [0.0, 0.0]


@pytest.mark.cuda
def test_cuda_graph_capture_after_warmup() -> None:
    xs = _cuda_set([1000, 65537], torch.float16)
    dst = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    s, found = torch.tensor(2.0, device="cuda"), torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up builds the tables outside the capture
        torch.ops.aiak.multi_tensor_scale_(xs, dst, s, found)
        torch.ops.aiak.multi_tensor_l2norm(dst, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.aiak.multi_tensor_scale_(xs, dst, s, found)
        total, _ = torch.ops.aiak.multi_tensor_l2norm(dst, True)
    for x in xs:
        x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.cat([x.double().flatten() * 2 for x in xs]).norm()
    assert_rel(total.reshape(1), ref.reshape(1), 1e-6)


def test_table_cache_drops_the_least_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_build(lists, device):  # the cache policy alone: no device table
        return _mta.Table(torch.zeros(1, dtype=torch.int64), 1, len(lists[0]), 0, None, 0)

    monkeypatch.setattr(_mta, "CACHE_SIZE", 3)
    monkeypatch.setattr(_mta, "build", fake_build)
    monkeypatch.setattr(_mta.Table, "wait", lambda self: None)
    _mta.clear_cache()
    sets = [[torch.ones(i + 1)] for i in range(5)]
    cpu = torch.device("cpu")

    def hit(i: int) -> _mta.Table | None:
        return _mta.lookup(_mta.key("t", [sets[i]]))

    try:
        tabs = [_mta.table([s], cpu, "t") for s in sets[:3]]
        assert hit(0) is tabs[0]  # set 0 is now the most recently used
        _mta.table([sets[3]], cpu, "t")  # full: set 1 goes
        assert hit(1) is None
        _mta.table([sets[4]], cpu, "t")  # then set 2
        assert hit(2) is None
        assert hit(0) is tabs[0] and hit(3) is not None and hit(4) is not None
        assert _mta.cache_info()["tables"] == 3 and len(_mta._used) == 3
        assert _mta.table([sets[0]], cpu, "t") is tabs[0]  # a hit does not rebuild
    finally:
        _mta.clear_cache()


@pytest.mark.cuda
def test_cuda_table_is_cached_per_tensor_set() -> None:
    _mta.clear_cache()
    xs = _cuda_set([10, 20, 30], torch.float32)
    aiak.ops.multi_tensor_l2norm(xs)
    aiak.ops.multi_tensor_l2norm(xs)
    assert _mta.cache_info()["tables"] == 1
    aiak.ops.multi_tensor_l2norm(xs[:2])
    assert _mta.cache_info()["tables"] == 2


@pytest.mark.cuda
def test_cuda_opcheck() -> None:
    ts = [torch.randn(5, device="cuda"), torch.randn(3, 4, device="cuda").half()]
    torch.library.opcheck(torch.ops.aiak.multi_tensor_l2norm.default, (ts, True))
    dst = [torch.empty(5, device="cuda").half(), torch.empty(3, 4, device="cuda")]
    torch.library.opcheck(
        torch.ops.aiak.multi_tensor_scale_.default,
        (ts, dst, torch.tensor(3.0, device="cuda"), torch.zeros(1, device="cuda")),
    )


@pytest.mark.cuda
def test_cuda_disabled_kernels_fall_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIAK_DISABLE_KERNELS", "1")
    xs = _cuda_set([100], torch.float32)
    with pytest.warns(RuntimeWarning, match="AIAK_DISABLE_KERNELS=1"):
        total, _ = aiak.ops.multi_tensor_l2norm(xs)
    assert_rel(total.reshape(1), xs[0].double().norm().reshape(1), 1e-6)
    assert "reference" in aiak.ops.backends()["ops"]["multi_tensor_l2norm"]


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_past_two_to_the_31_elements() -> None:
    n = 2**31 + 5
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * n * 2:
        pytest.skip(f"needs {3 * n * 2 / 2**30:.1f} GiB of free GPU memory, has {free / 2**30:.1f}")
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-1] = 3.0  # the last element lies past 2^31: a 32-bit offset would miss it
    total, _ = aiak.ops.multi_tensor_l2norm([x])
    assert total.item() == pytest.approx(math.sqrt(n - 1 + 9), rel=1e-6)
    found = aiak.ops.multi_tensor_scale_([x], [x], 2.0)
    assert x[-1].item() == 6.0 and x[-2].item() == 2.0 and found.item() == 0.0


@pytest.mark.cuda
def test_cuda_validated_fast_path_is_not_fooled_by_views() -> None:
    # A cached (validated) table is keyed by address, size and dtype; a strided view with the
    # same address and size must still be checked and computed as what it is.
    x = torch.randn(2000, device="cuda")
    head, strided = x[:1000], x[::2]
    assert head.data_ptr() == strided.data_ptr() and head.numel() == strided.numel()
    aiak.ops.multi_tensor_l2norm([head])
    total, _ = aiak.ops.multi_tensor_l2norm([strided])
    assert_rel(total.reshape(1), strided.double().norm().reshape(1), 1e-6)
    dst = torch.empty(1000, device="cuda")
    aiak.ops.multi_tensor_scale_([head], [dst], 2.0)
    with pytest.raises(ValueError, match="dense"):
        aiak.ops.multi_tensor_scale_([strided], [dst], 2.0)
    with pytest.raises(ValueError, match="scale is on cpu"):
        torch.ops.aiak.multi_tensor_scale_(
            [head], [dst], torch.ones(()), torch.zeros(1, device="cuda")
        )


def _bound_norm_cases(device: str) -> None:
    """BoundNorm equals the op when grads stay, move, change values, or change layout."""

    g = torch.Generator().manual_seed(3)
    shapes = [(7, 3), (5,), (70_000,), (0,), (2, 2, 2)]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    norm = BoundNorm()
    for step in range(4):
        expected = aiak.ops.multi_tensor_l2norm(grads)[0]
        torch.testing.assert_close(norm(grads), expected, rtol=1e-6, atol=0)
        if step == 1:  # new tensors (zero_grad(set_to_none=True) and a new backward)
            grads = [t * 2 for t in grads]
        else:  # the same tensors, new values (zero_grad(set_to_none=False))
            for t in grads:
                t.mul_(0.5)
    strided = [t.t() if t.dim() == 2 else t for t in grads]  # a transposed view: not contiguous
    torch.testing.assert_close(norm(strided), aiak.ops.multi_tensor_l2norm(strided)[0])


def test_bound_norm_matches_the_op() -> None:
    _bound_norm_cases("cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bound_norm_is_a_no_grad_norm(device: str) -> None:
    grads = [torch.randn(5, device=device, requires_grad=True), torch.randn(3, device=device)]
    norm = BoundNorm()
    for _ in range(2):  # the op, then (on CUDA) the kept table
        total = norm(grads)
        assert not total.requires_grad and total.grad_fn is None
        ref = torch.cat([g.detach().double() for g in grads]).norm()
        assert_rel(total.reshape(1), ref.reshape(1), 1e-6)


@pytest.mark.cuda
def test_bound_norm_matches_the_op_on_cuda_and_keeps_its_table(monkeypatch) -> None:
    import importlib

    _bound_norm_cases("cuda")
    module = importlib.import_module("aiak.ops.multi_tensor_l2norm")
    calls = []
    op = module.multi_tensor_l2norm
    monkeypatch.setattr(module, "multi_tensor_l2norm", lambda *a: calls.append(1) or op(*a))
    grads = [torch.randn(100, device="cuda") for _ in range(3)]
    norm = module.BoundNorm()
    first = norm(grads)
    assert len(calls) == 1 and norm._table is not None
    grads[1].mul_(2)
    second = norm(grads)  # the fast path: the kept table, not the op
    assert len(calls) == 1
    torch.testing.assert_close(second, op(grads)[0])
    assert not torch.equal(first, second)
    norm([t.clone() for t in grads])  # moved: the op again
    assert len(calls) == 2
