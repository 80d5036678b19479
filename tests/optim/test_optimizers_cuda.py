"""aiak.optim's CUDA kernels (``pytest -m cuda tests/optim``).

One run says whether the kernels are right: parity with torch's CUDA fused Adam/AdamW/SGD for
every option and dtype, LAMB/LARS against float64, odd sizes around the 65,536-element chunk,
unaligned views, mixed dtypes in one launch, GradScaler skip without host sync, CUDA graph
capture, amp copy-back, state_dict round trips, the ops' reference on CUDA.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from _optim_helpers import clones, lamb_reference, lars_reference, make_params, rel_l2

import aiak.ops
from aiak.ops import _capability as _cap
from aiak.optim import LAMB, LARS, FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

pytestmark = pytest.mark.cuda

# Sizes around the chunk (65,536) and the 4-element vector: tails, single elements, empties.
EDGE = [(0,), (1,), (7,), (65535,), (65536,), (65537,), (3, 43691), (257, 1025)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
K = 10


def _params(dtype, unaligned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_params(EDGE, dtype, "cuda", g, unaligned=unaligned)


def _drive(pairs, steps, seed=1, grad_dtype=None):
    g = torch.Generator().manual_seed(seed)
    first = pairs[0][1]
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in first]
        for opt, ps in pairs:
            for p, x in zip(ps, grads):
                p.grad = x.to(device=p.device, dtype=grad_dtype or p.dtype)
            opt.step()


def _close(a, b, dtype):
    # fp32: the same math as torch's kernel up to its fp64 intermediates (a few ulp after 10
    # steps), element by element. fp16/bf16: within one rounding step in relative L2; single
    # elements may differ by a few ulp where exp_avg_sq is an fp16 subnormal (a handful of
    # elements per 65,535, a few ulp each, after 10 Adam steps).
    if dtype == torch.float32:
        assert rel_l2(a, b) <= 1e-6
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    else:
        assert rel_l2(a, b) <= torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("adam_w", "amsgrad", "maximize", "wd"),
    list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.1])),
)
def test_adam_matches_torch_cuda_fused(dtype, adam_w, amsgrad, maximize, wd) -> None:
    ps = _params(dtype, unaligned=amsgrad)  # unaligned views on half of the cases
    a, b = clones(ps), clones(ps)
    kw = {"lr": 1e-2, "weight_decay": wd, "amsgrad": amsgrad, "maximize": maximize}
    groups_a = [{"params": a[:4]}, {"params": a[4:], "lr": 3e-3}]
    groups_b = [{"params": b[:4]}, {"params": b[4:], "lr": 3e-3}]
    ours = FusedAdam(groups_a, adam_w_mode=adam_w, **kw)
    ref = (torch.optim.AdamW if adam_w else torch.optim.Adam)(groups_b, fused=True, **kw)
    _drive([(ours, a), (ref, b)], K)
    _close(a, b, dtype)
    for p, q in zip(a, b):
        _close([ours.state[p]["exp_avg_sq"]], [ref.state[q]["exp_avg_sq"]], dtype)
        assert float(ours.state[p]["step"]) == K


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "wd", "maximize"),
    [
        (0.0, 0.0, False, 0.0, False),
        (0.9, 0.0, False, 0.1, False),
        (0.9, 0.1, False, 0.0, True),
        (0.9, 0.0, True, 0.1, False),
    ],
)
def test_sgd_matches_torch_cuda_fused(dtype, momentum, dampening, nesterov, wd, maximize):
    ps = _params(dtype, unaligned=dampening > 0)
    a, b = clones(ps), clones(ps)
    kw = {
        "lr": 0.1,
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": wd,
        "maximize": maximize,
    }
    ours, ref = FusedSGD(a, **kw), torch.optim.SGD(b, fused=True, **kw)
    _drive([(ours, a), (ref, b)], K)
    _close(a, b, dtype)


def test_mixed_dtypes_in_one_group() -> None:
    ps = [p for d in DTYPES for p in _params(d, seed=3)]
    a, b = clones(ps), clones(ps)
    ours, ref = FusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    _drive([(ours, a), (ref, b)], 5)
    for x, y in zip(a, b):
        _close([x], [y], x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32])  # half: vs the foreach path, below
@pytest.mark.parametrize(
    ("adam_w", "nvlamb", "wd", "max_norm"),
    [(True, False, 0.01, 1.0), (False, True, 0.0, 1.0), (True, False, 0.01, 0.0)],
)
def test_lamb_matches_float64(dtype, adam_w, nvlamb, wd, max_norm) -> None:
    ps = _params(dtype, unaligned=not adam_w)
    g = torch.Generator().manual_seed(9)
    grads = {t: [torch.randn(p.shape, generator=g) for p in ps] for t in range(1, K + 1)}
    opts = {
        "lr": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": wd,
        "adam_w_mode": adam_w,
        "use_nvlamb": nvlamb,
        "max_grad_norm": max_norm,
    }
    a = clones(ps)
    opt = FusedLAMB([{"params": a[:3]}, {"params": a[3:]}], **opts)
    for t in range(1, K + 1):
        for p, x in zip(a, grads[t]):
            p.grad = x.to(device="cuda", dtype=dtype)
        opt.step()
    ref = lamb_reference(
        [p.cpu() for p in ps], lambda t: [x.to(dtype) for x in grads[t]], K, **opts
    )
    assert rel_l2([p.cpu() for p in a], ref) <= 1e-5


@pytest.mark.parametrize("exclude_1d", [True, False])
def test_lars_matches_float64(exclude_1d) -> None:
    ps = _params(torch.float32)
    g = torch.Generator().manual_seed(4)
    grads = {t: [torch.randn(p.shape, generator=g) for p in ps] for t in range(1, K + 1)}
    opts = {
        "lr": 0.5,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "trust_coefficient": 0.02,
        "eps": 1e-8,
        "exclude_1d": exclude_1d,
    }
    a = clones(ps)
    opt = LARS(a, **opts)
    for t in range(1, K + 1):
        for p, x in zip(a, grads[t]):
            p.grad = x.cuda()
        opt.step()
    ref = lars_reference([p.cpu() for p in ps], lambda t: grads[t], K, **opts)
    assert rel_l2([p.cpu() for p in a], ref) <= 1e-5


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdamW(p, lr=1e-2),
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: LAMB(p, lr=1e-2, weight_decay=0.01),
        lambda p: LARS(p, lr=0.1),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_the_ops_reference_on_cuda(dtype, make, monkeypatch) -> None:
    ps = _params(dtype, seed=5)
    a, b = clones(ps), clones(ps)
    oa, ob = make(a), make(b)
    g = torch.Generator().manual_seed(6)
    for _ in range(K):
        grads = [torch.randn(p.shape, generator=g).to("cuda", dtype) for p in a]
        for p, q, x in zip(a, b, grads):
            p.grad, q.grad = x.clone(), x.clone()
        oa.step()
        with monkeypatch.context() as m, pytest.warns(RuntimeWarning, match="reference"):
            m.setenv("AIAK_DISABLE_KERNELS", "1")  # the op's reference, on CUDA tensors
            _cap.clear_warnings()
            ob.step()
    assert rel_l2(a, b) <= (1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdamW(p, lr=1e-2),
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: LAMB(p, lr=1e-2, weight_decay=0.01),
        lambda p: LARS(p, lr=0.1),
    ],
)
@pytest.mark.parametrize("reference", [False, True])
def test_grad_scaler_skip_on_device_without_host_sync(make, reference, monkeypatch) -> None:
    if reference:  # the op's reference on CUDA tensors: also no host sync
        monkeypatch.setenv("AIAK_DISABLE_KERNELS", "1")
    ps = clones(_params(torch.float32, seed=7))
    opt = make(ps)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)

    def scaled_step(grads):
        s = scaler.scale(torch.ones((), device="cuda"))
        for p, x in zip(ps, grads):
            p.grad = x * s
        scaler.step(opt)
        scaler.update()

    scaled_step([torch.randn_like(p) for p in ps])  # warm-up: compile, tables, state
    saved = [p.detach().clone() for p in ps]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    grads = [torch.randn_like(p) for p in ps]
    grads[4].view(-1)[123] = float("inf")
    s = scaler.scale(torch.ones((), device="cuda"))
    for p, x in zip(ps, grads):
        p.grad = x * s
    # What GradScaler.step hands a `_step_supports_amp_scaling` optimizer, set by hand so that
    # only step() runs under the sync check (GradScaler.update itself reads the flag).
    opt.grad_scale, opt.found_inf = s.reshape(1), torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        del opt.grad_scale, opt.found_inf
    for p, old, st in zip(ps, saved, states):
        torch.testing.assert_close(p.detach(), old, rtol=0, atol=0)
        for k, v in st.items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0)


def test_capturable_step_in_cuda_graph() -> None:
    ps = _params(torch.float32, seed=8)
    a, b = clones(ps), clones(ps)
    lr = torch.tensor(1e-2, device="cuda")
    # No weight decay: the warm-up step on zero grads then moves nothing but the step count.
    oa = FusedAdamW(a, lr=lr, weight_decay=0.0, capturable=True)
    ob = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.0, fused=True)
    static = [torch.zeros_like(p) for p in a]
    for p, s in zip(a, static):
        p.grad = s
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: state and tables
        oa.step()
    torch.cuda.current_stream().wait_stream(side)
    for p in a:  # undo the warm-up step (zero grads moved nothing but the step count)
        oa.state[p]["step"].zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oa.step()
    g = torch.Generator().manual_seed(2)
    for t in range(5):
        grads = [torch.randn(p.shape, generator=g).cuda() for p in a]
        for s, q, x in zip(static, b, grads):
            s.copy_(x)
            q.grad = x.clone()
        if t == 3:  # a scheduler writing the lr tensor is seen by the graph
            lr.fill_(5e-3)
            ob.param_groups[0]["lr"] = 5e-3
        graph.replay()
        ob.step()
    torch.cuda.synchronize()
    _close(a, b, torch.float32)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdamW(p, lr=1e-2),
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
        lambda p: LAMB(p, lr=1e-2, weight_decay=0.01),
    ],
)
def test_amp_copy_back_in_kernel(model_dtype, make) -> None:
    masters = clones(_params(torch.float32, seed=10))
    models = [m.detach().to(model_dtype) for m in masters]
    opt = make(masters)
    opt._aiak_copy_back = dict(zip(masters[1:], models[1:]))
    stale = models[0].clone()
    _drive([(opt, masters)], 3)
    for m, d in zip(masters[1:], models[1:]):
        torch.testing.assert_close(d, m.detach().to(model_dtype), rtol=0, atol=0)
    torch.testing.assert_close(models[0], stale, rtol=0, atol=0)


@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_state_dict_round_trip_with_torch_fused(direction) -> None:
    ps = _params(torch.float32, seed=11)
    a = clones(ps)

    def ours(p):
        return FusedAdamW(p, lr=1e-2, amsgrad=True)

    def theirs(p):
        return torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True)

    first, second = (ours, theirs) if direction == "ours->torch" else (theirs, ours)
    oa = first(a)
    _drive([(oa, a)], 3)
    b = clones(a)
    ob = second(b)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    _drive([(oa, a), (ob, b)], 5, seed=12)
    _close(a, b, torch.float32)


def test_one_launch_per_group_no_host_sync() -> None:
    ps = clones(_params(torch.float32, seed=13))
    opt = FusedAdamW(ps, lr=1e-2)
    _drive([(opt, ps)], 1)  # warm-up
    for p in ps:
        p.grad.normal_()  # same grad tensors: the cached address table is reused, no upload
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names.count("fused_adam") == 1, names
    assert len(names) <= 2, names  # the update and the step counters


def test_no_fallback_warning_with_cupy() -> None:
    if aiak.ops.backends()["cupy"]["available"] is False:
        pytest.skip("cupy is not installed here")
    ps = clones(_params(torch.float16, seed=14))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
        qs = clones(ps)
        _drive([(FusedAdamW(ps), ps), (LAMB(qs), qs)], 1)
