"""aiak::window_attention, roll_window_partition and window_merge_roll.

CPU: the reference against the literal float64 implementations of ``_window_literal.py``,
gradients (gradcheck), input errors, the fallback path, opcheck, the eager path against the
op's. The kernels against the reference on CUDA: test_window_attention_cuda.py. ``convert``
(models): test_swin.py.
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings

import pytest
import torch
from _numerics import rel_err as _rel
from _window_helpers import Copies
from _window_helpers import both_paths as _both_paths
from _window_helpers import opcheck_all as _opcheck_all
from _window_literal import inputs, literal_attention, literal_partition, rel_index, swin_mask

import aiak.ops  # noqa: F401
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import _window_attention_ref as war
from aiak.ops import window_partition as wp
from aiak.ops.window_attention import roll_window_partition, window_attention, window_merge_roll

# the module, not the function aiak.ops exports under the same name
wa = importlib.import_module("aiak.ops.window_attention")

# ------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nw", [None, 1, 4])
def test_reference_matches_literal(nw):
    q, k, v, bias, mask = inputs(8, 3, 9, 4, nw)
    out = window_attention(q, k, v, bias, mask, 0.37)
    torch.testing.assert_close(out, literal_attention(q, k, v, bias, mask, 0.37))


def test_reference_half_computes_in_fp32():
    q, k, v, bias, mask = inputs(4, 2, 7, 8, 2, dtype=torch.bfloat16)
    out = window_attention(q, k, v, bias, mask, 0.5)
    assert out.dtype == torch.bfloat16
    exact = literal_attention(q, k, v, bias, mask, 0.5)
    # one bf16 rounding of the result: relative error ~ 2^-9
    assert _rel(out, exact) < 4e-3


def test_default_scale_is_head_dim_rsqrt():
    q, k, v, bias, _ = inputs(2, 1, 5, 16)
    torch.testing.assert_close(
        window_attention(q, k, v, bias), literal_attention(q, k, v, bias, None, 0.25)
    )


@pytest.mark.parametrize("nw", [None, 2])
def test_gradcheck(nw):
    q, k, v, bias, mask = inputs(4, 2, 5, 3, nw)
    args = [t.requires_grad_() for t in (q, k, v, bias)]
    assert torch.autograd.gradcheck(lambda *a: window_attention(*a, mask, 0.7), args)


def test_backward_op_matches_autograd_of_literal():
    q, k, v, bias, mask = inputs(6, 2, 7, 4, 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    dout = torch.randn(q.shape, dtype=torch.float64)
    literal_attention(*leaves, mask, 0.4).backward(dout)
    grads = torch.ops.aiak.window_attention_backward(dout, q, k, v, bias, mask, 0.4)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)


@pytest.mark.parametrize("nw", [None, 3])
def test_tokens_first_is_the_transposed_output_with_the_same_gradients(nw):
    # the [B_, N, nH, D] layout: the same numbers as the default layout transposed, forward and
    # every gradient, the incoming gradient read through its strides
    q, k, v, bias, mask = inputs(6, 2, 7, 4, nw)
    dout = torch.randn(6, 7, 2, 4, dtype=torch.float64)
    ref, ref_grads = _both_paths(
        lambda *t: window_attention(*t, mask, 0.4).transpose(1, 2), (q, k, v, bias), dout
    )
    out, grads = _both_paths(
        lambda *t: window_attention(*t, mask, 0.4, tokens_first=True), (q, k, v, bias), dout
    )
    assert out.shape == (6, 7, 2, 4) and out.is_contiguous()
    assert torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="tokens_first must be a bool"):
        window_attention(q, k, v, bias, mask, 0.4, tokens_first="yes")


def _qkv_case(dtype=torch.float64, device="cpu"):
    qkv = torch.randn(6, 7, 3 * 2 * 4, dtype=dtype, device=device)
    bias = torch.randn(2, 7, 7, dtype=torch.float64, device=device).to(dtype)
    mask = torch.where(torch.rand(3, 7, 7, device=device) < 0.3, -100.0, 0.0).to(dtype)
    return qkv, bias, mask, torch.randn(6, 7, 8, dtype=dtype, device=device)


def _unpacked(qkv, bias, mask):
    q, k, v = qkv.view(6, 7, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
    return window_attention(q, k, v, bias, mask, 0.4, tokens_first=True).reshape(6, 7, 8)


@pytest.mark.parametrize("eager", [False, True])
def test_qkv_entry_is_the_op_on_views_of_qkv(eager, monkeypatch):
    # window_attention_qkv against window_attention on timm's views of qkv: the same outputs and
    # gradients, through the op (CPU) and through the eager path's Function (CPU tensors standing
    # in for CUDA ones; the launchers run the reference and write the qkv gradient's views)
    qkv, bias, mask, grad = _qkv_case()
    want, want_grads = _both_paths(lambda *t: _unpacked(*t, mask), (qkv, bias), grad)
    if eager:
        monkeypatch.setattr(wac, "eager", wac.eager_on("cpu"))
        calls = []
        real = wa._EagerPackedAttention.apply
        monkeypatch.setattr(
            wa._EagerPackedAttention, "apply", lambda *a: calls.append(1) or real(*a)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback's one-time warning
        got, got_grads = _both_paths(
            lambda *t: wa.window_attention_qkv(t[0], 2, t[1], mask, 0.4), (qkv, bias), grad
        )
    assert calls if eager else True
    assert got.shape == (6, 7, 8) and torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_qkv_entry_checks_its_arguments():
    qkv, bias, mask, _ = _qkv_case(torch.float32)
    with pytest.raises(TypeError, match="heads must be a positive int"):
        wa.window_attention_qkv(qkv, 2.0, bias, mask)
    with pytest.raises(ValueError, match="qkv must be"):
        wa.window_attention_qkv(qkv, 5, bias, mask)
    with pytest.raises(ValueError, match="qkv must be"):
        wa.window_attention_qkv(qkv[0], 2, bias, mask)
    with pytest.raises(TypeError, match="qkv must be a Tensor"):
        wa.window_attention_qkv([qkv], 2, bias, mask)
    with pytest.raises(ValueError, match="bias must be"):
        wa.window_attention_qkv(qkv, 2, bias[:1], mask)


def test_backward_op_reads_a_strided_grad():
    q, k, v, bias, mask = inputs(4, 3, 5, 8, 2)
    dout = torch.randn(4, 5, 3, 8, dtype=torch.float64)
    strided = torch.ops.aiak.window_attention_backward(
        dout.transpose(1, 2), q, k, v, bias, mask, 0.3
    )
    dense = torch.ops.aiak.window_attention_backward(
        dout.transpose(1, 2).contiguous(), q, k, v, bias, mask, 0.3
    )
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="grad has shape"):
        torch.ops.aiak.window_attention_backward(dout, q, k, v, bias, mask, 0.3)


def test_bias_gradient_in_fp32_with_half_inputs_under_autocast_dtypes():
    # autocast hands the op half q/k/v and an fp32 bias: the bias grad stays fp32
    q, k, v, _, mask = inputs(4, 2, 5, 8, 2, dtype=torch.bfloat16)
    bias = torch.randn(2, 5, 5, requires_grad=True)
    window_attention(q, k, v, bias, mask, 0.3).float().sum().backward()
    assert bias.grad.dtype == torch.float32 and torch.isfinite(bias.grad).all()


# ------------------------------------------------------------------------------------------
# partition / merge
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ws", "shift"), [(7, 0), (7, 3), (4, 2), (2, 5)])
def test_partition_matches_literal_and_merge_inverts(ws, shift):
    x = torch.randn(2, 4 * ws, 2 * ws, 5)
    win = roll_window_partition(x, ws, shift)
    torch.testing.assert_close(win, literal_partition(x, ws, shift), rtol=0, atol=0)
    torch.testing.assert_close(window_merge_roll(win, 4 * ws, 2 * ws, shift), x, rtol=0, atol=0)


def test_partition_gradients():
    x = torch.randn(1, 8, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: roll_window_partition(t, 4, 1), (x,))
    w = torch.randn(2, 16, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: window_merge_roll(t, 8, 4, 1), (w,))


# ------------------------------------------------------------------------------------------
# errors and fallbacks
# ------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    q, k, v, bias, mask = inputs(4, 2, 5, 8, 2, dtype=torch.float32)
    cases = [
        ((q[0], k, v, bias, None), ValueError, "q must be"),
        ((q, k[:, :1], v, bias, None), ValueError, "k has shape"),
        ((q, k, v.half(), bias, None), TypeError, "v has dtype"),
        ((q, k, v, bias[:1], None), ValueError, "bias must be"),
        ((q, k, v, bias, mask[:, :3]), ValueError, "mask must be"),
        ((q, k, v, bias, torch.zeros(3, 5, 5)), ValueError, "does not divide"),
        ((q, k, v.int(), bias, None), TypeError, "v has dtype"),
        ((q, k, v, "bias", None), TypeError, "bias must be a Tensor"),
    ]
    for args, exc, text in cases:
        with pytest.raises(exc, match=text):
            window_attention(*args, 0.3)
    with pytest.raises(TypeError, match="scale"):
        window_attention(q, k, v, bias, None, "x")
    with pytest.raises(ValueError, match="mask must not require grad"):
        window_attention(q, k, v, bias, mask.requires_grad_(), 0.3)
    x = torch.randn(1, 14, 14, 3)
    with pytest.raises(ValueError, match="multiples of window"):
        roll_window_partition(x, 5, 0)
    with pytest.raises(ValueError, match="shift"):
        roll_window_partition(x, 7, -1)
    with pytest.raises(ValueError, match="x must be"):
        roll_window_partition(x[0], 7, 0)
    with pytest.raises(ValueError, match="not a square"):
        window_merge_roll(torch.randn(4, 10, 3), 14, 14, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        window_merge_roll(torch.randn(3, 49, 3), 14, 14, 0)


def test_unsupported_shapes_are_named():
    q = torch.empty(1, 1, 144, 48)
    assert war._shape_reasons(q) == [
        "window_attention: N = 144 tokens per window > 64",
        "window_attention: head_dim 48 not in (32, 64)",
    ]
    assert war._shape_reasons(torch.empty(1, 1, 49, 32)) == []


def test_kernel_switch_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(wa.KERNEL_ENV, "scalar")
    assert wa.attention_kernel(torch.device("cuda", 0)) == "scalar"
    monkeypatch.setenv(wa.KERNEL_ENV, "tensor")
    with pytest.raises(ValueError, match="AIAK_WINDOW_ATTENTION_KERNEL"):
        wa.attention_kernel(torch.device("cuda", 0))
    monkeypatch.delenv(wa.KERNEL_ENV)
    assert wa.DEFAULT_KERNEL in wa.KERNEL_CHOICES
    q, k, v, bias, _ = inputs(2, 1, 5, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        wac._attention_cuda_with("tensor", q, k, v, bias, None, 0.3)
    with pytest.raises(ValueError, match="kernel must be one of"):
        wac._attention_backward_cuda_with("tensor", q, q, k, v, bias, None, 0.3)


def test_mma_shared_memory_fits_and_alignment_copies():
    # the kernels' layout (WM_* in the source): table + tiles (+ P and dS) within 227 KiB
    assert wac._mma_smem_bytes(32, backward=False) == 64 * 72 * 4 + 3 * 64 * 40 * 2
    assert wac._mma_smem_bytes(64, backward=True) == 64 * 72 * 4 + 4 * 64 * 72 * 2 + 64 * 72 * 4
    # P and dS in one tile: four blocks fit in an H100 SM's 228 KiB at D = 32
    assert (
        wac._mma_smem_bytes(32, True, alias_ps=True) == 64 * 72 * 4 + 4 * 64 * 40 * 2 + 64 * 72 * 2
    )
    assert 228 * 1024 // (wac._mma_smem_bytes(32, True, alias_ps=True) + 1024) == 4
    assert max(wac._mma_smem_bytes(d, b) for d in (32, 64) for b in (False, True)) < 227 * 1024
    x = torch.randn(4, 3, 49, 3, 32, dtype=torch.float16).permute(3, 0, 1, 2, 4)[0]
    assert wac._mma_ready(x) is x  # timm's qkv view: aligned, 8-element strides, no copy
    odd = torch.randn(4 * 3 * 49 * 33 + 1, dtype=torch.float16)[1:].view(4, 3, 49, 33)[..., :32]
    fixed = wac._mma_ready(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    assert fixed.data_ptr() % 16 == 0


@pytest.mark.parametrize("regs", [80, 128, 168, 234])
def test_mma_grid_keeps_one_mask_per_block(monkeypatch, regs):
    # the mma kernels fold mask[g % nW] into each block's table once: G must be a multiple of nW
    # (and at most B*nW); one wave when nW x nH blocks fit at all
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    monkeypatch.setattr(wac, "_num_regs", lambda fn, device: regs)
    monkeypatch.setattr(wac._cuda, "num_sms", lambda device: 132)
    for d, backward in itertools.product((32, 64), (False, True)):
        smem = wac._mma_smem_bytes(d, backward)
        per_sm = min(16, 65536 // (-(-regs // 8) * 8 * 128), 228 * 1024 // (smem + 1024))
        for batch, heads, nw in itertools.product((1, 3, 64, 4096), (3, 6, 12, 24), (1, 4, 16, 64)):
            windows = batch * nw
            g = wac._mma_blocks(None, windows, heads, nw, smem)
            assert g % nw == 0 and 0 < g <= windows
            if nw * heads <= per_sm * 132:
                assert g * heads <= per_sm * 132


@pytest.fixture
def launches(recorder, monkeypatch):
    """The launchers on CPU tensors with the launches recorded (tests/ops/conftest.py)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    monkeypatch.setattr(wac, "_PLANS", {})
    monkeypatch.setattr(wac, "_CARVED", set())
    monkeypatch.setattr(wac, "use_kernel", lambda *a, **k: True)
    return recorder


@pytest.mark.parametrize("kernel", wa.KERNEL_CHOICES)
def test_layouts_reach_the_kernels_as_strides_without_copies(launches, kernel):
    # timm's q/k/v views in, a [B_, N, nH, D] output, and proj's input gradient seen as
    # [B_, nH, N, D] back in: the kernels get pointers and strides, nothing is copied
    windows, heads, n, d = 4, 3, 49, 32
    q, k, v = torch.randn(windows, n, 3, heads, d).half().permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(heads, n, n)
    grad = torch.randn(windows, n, heads, d).half().transpose(1, 2)
    for _ in range(2):  # the plan made, then the plan cached
        with Copies() as copies:
            out = wac._attention_cuda_with(kernel, q, k, v, bias, None, 0.2, tokens_first=True)
            wac._attention_backward_cuda_with(kernel, grad, q, k, v, bias, None, 0.2)
        assert copies.count == 0
    assert out.shape == (windows, n, heads, d) and out.is_contiguous()
    fwd, bwd = (launch["args"] for launch in launches.launches[-2:])
    assert fwd["out"] == out.data_ptr()
    assert (fwd["ob"], fwd["oh"], fwd["on"]) == out.transpose(1, 2).stride()[:3]
    assert (fwd["qb"], fwd["qh"], fwd["qn"]) == q.stride()[:3]
    assert bwd["dout"] == grad.data_ptr()
    assert (bwd["gb"], bwd["gh"], bwd["gn"]) == grad.stride()[:3]
    out = wac._attention_cuda_with(kernel, q, k, v, bias, None, 0.2)
    args = launches.launches[-1]["args"]
    assert out.shape == q.shape and (args["ob"], args["oh"], args["on"]) == out.stride()[:3]


@pytest.mark.parametrize("variant", list(wa.BWD_VARIANTS))
def test_each_bwd_variant_launches_its_kernel_with_its_shared_memory(launches, variant):
    q, k, v, dout = (torch.randn(8, 3, 49, 32).half() for _ in range(4))
    bias, mask = torch.randn(3, 49, 49), torch.zeros(2, 49, 49)
    wac._attention_backward_cuda_with("mma", dout, q, k, v, bias, mask, 0.3, variant)
    (launch,) = launches.launches
    infix = wa.BWD_VARIANTS[variant].infix
    assert launch["name"] == f"window_attention_mma_bwd_{infix}f16_d32"
    alias = wa.BWD_VARIANTS[variant].alias_ps
    assert launch["dims"][6] == wac._mma_smem_bytes(32, True, alias)
    assert launch["args"]["dout"] == dout.data_ptr()
    with pytest.raises(ValueError, match="variant must be one of"):
        wac._attention_backward_cuda_with("mma", dout, q, k, v, bias, mask, 0.3, "fast")


@pytest.mark.parametrize("variant", list(wa.FWD_VARIANTS))
def test_each_fwd_variant_launches_its_kernel(launches, variant):
    q, k, v = (torch.randn(8, 3, 49, 32).half() for _ in range(3))
    bias, mask = torch.randn(3, 49, 49), torch.zeros(2, 49, 49)
    out = wac._attention_cuda_with("mma", q, k, v, bias, mask, 0.3, True, variant)
    (launch,) = launches.launches
    infix = wa.FWD_VARIANTS[variant]
    assert launch["name"] == f"window_attention_mma_fwd_{infix}f16_d32"
    assert launch["dims"][6] == wac._mma_smem_bytes(32, False)
    assert launch["args"]["out"] == out.data_ptr()
    with pytest.raises(ValueError, match="variant must be one of"):
        wac._attention_cuda_with("mma", q, k, v, bias, mask, 0.3, True, "fast")


def test_bwd_variants_are_declared_as_the_source_builds_them():
    # each variant: one WM_BACKWARD_V line per dtype and head dim, its ALIAS switch the
    # shared-memory layout the host sizes
    import re

    from aiak.ops import _cuda

    lines = re.findall(
        r"^WM_BACKWARD_V\((\w+), \w+, (\d+), (\d+), (true|false), (true|false), (true|false)\)",
        _cuda.kernel_source("window_attention.cu"),
        re.M,
    )
    built = {name: (int(d), alias == "true") for name, d, _, _, alias, _ in lines}
    declared = {}
    for variant in wa.BWD_VARIANTS.values():
        for code in ("f16", "bf16"):
            for d in (32, 64):
                declared[f"window_attention_mma_bwd_{variant.infix}{code}_d{d}"] = (
                    d,
                    variant.alias_ps,
                )
    assert built == declared
    assert wa.DEFAULT_BWD_VARIANT in wa.BWD_VARIANTS
    forwards = re.findall(
        r"^WM_FORWARD_V\((\w+), \w+, \d+, \d+, (?:true|false)\)",
        _cuda.kernel_source("window_attention.cu"),
        re.M,
    )
    assert sorted(forwards) == sorted(
        f"window_attention_mma_fwd_{infix}{code}_d{d}"
        for infix in wa.FWD_VARIANTS.values()
        for code in ("f16", "bf16")
        for d in (32, 64)
    )
    assert wa.DEFAULT_FWD_VARIANT in wa.FWD_VARIANTS


@pytest.mark.parametrize(
    ("read", "env", "variants", "default"),
    [
        (wa.bwd_variant, wa.BWD_VARIANT_ENV, wa.BWD_VARIANTS, wa.DEFAULT_BWD_VARIANT),
        (wa.fwd_variant, wa.FWD_VARIANT_ENV, wa.FWD_VARIANTS, wa.DEFAULT_FWD_VARIANT),
    ],
)
def test_variant_switch_is_read_once_and_checked(monkeypatch, read, env, variants, default):
    first, last = list(variants)[-1], next(iter(variants))
    read.cache_clear()
    monkeypatch.setenv(env, first)
    try:
        assert read() == first
        monkeypatch.setenv(env, last)
        assert read() == first  # fixed for the process once read
        read.cache_clear()
        monkeypatch.setenv(env, "fastest")
        with pytest.raises(ValueError, match=env):
            read()
        read.cache_clear()
        monkeypatch.delenv(env)
        assert read() == default
    finally:
        read.cache_clear()


def test_cuda_entry_on_cpu_falls_back_with_one_warning():
    q, k, v, bias, mask = inputs(4, 2, 5, 8, 2, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = wac._attention_cuda(q, k, v, bias, mask, 0.3)
        b = wac._attention_cuda(q, k, v, bias, mask, 0.3)
    relevant = [w for w in rec if "window_attention" in str(w.message)]
    assert len(relevant) <= 1  # once per process (an earlier test may have used it up)
    torch.testing.assert_close(a, war._attention_reference(q, k, v, bias, mask, 0.3))
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ------------------------------------------------------------------------------------------


def test_opcheck_cpu():
    _opcheck_all("cpu", torch.float32)


def test_literal_helpers_agree():  # the test's own ground truth is consistent
    x = torch.randn(1, 14, 14, 2)
    win = literal_partition(x, 7, 3)
    assert win.shape == (4, 49, 2)
    m = swin_mask(14, 14, 7, 3)
    assert m.shape == (4, 49, 49) and set(m.unique().tolist()) <= {0.0, -100.0}
    assert math.isclose(float(m[0].abs().sum()), 0.0)  # the top-left window is unmasked
    assert list(itertools.islice(rel_index(2).flatten().tolist(), 4)) == [4, 3, 1, 0]


# ------------------------------------------------------------------------------------------
# the eager path (autograd.Function calling the launchers) against the op's dispatcher path
# ------------------------------------------------------------------------------------------


def _eager_vs_op(device, dtype, monkeypatch, exact_bias):
    q, k, v, bias, mask = inputs(8, 3, 49, 32, 4, dtype=dtype, device=device)
    bias = bias.float()
    dout = torch.randn_like(q)
    calls = []
    real = wa._EagerAttention.apply
    monkeypatch.setattr(wa._EagerAttention, "apply", lambda *a: calls.append(1) or real(*a))
    for tf in (False, True):
        grad = dout.transpose(1, 2).contiguous() if tf else dout
        eager = _both_paths(
            lambda *t, tf=tf: window_attention(*t, mask, 0.2, tf), (q, k, v, bias), grad
        )
        assert calls, "the eager path did not run"
        op = _both_paths(
            lambda *t, tf=tf: wa.ATTENTION_OP.overload(*t, mask, 0.2, tf), (q, k, v, bias), grad
        )
        assert torch.equal(eager[0], op[0])
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), eager[1], op[1]):
            assert a.dtype == b.dtype, name
            if name != "dbias" or exact_bias:
                assert torch.equal(a, b), name
            else:  # the kernel sums the bias gradient with fp32 atomics: order varies by run
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 14, 14, 6, device=device).to(dtype)
    gx = torch.randn(8, 49, 6, device=device).to(dtype)
    a = _both_paths(lambda t: roll_window_partition(t, 7, 3), (x,), gx)
    b = _both_paths(lambda t: wp.PARTITION_OP.overload(t, 7, 3), (x,), gx)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])
    a = _both_paths(lambda t: window_merge_roll(t, 14, 14, 3), (gx,), x)
    b = _both_paths(lambda t: wp.MERGE_OP.overload(t, 14, 14, 3), (gx,), x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])


def test_eager_path_matches_op_path_cpu(monkeypatch):
    # CPU tensors take the eager branch as CUDA ones would: the Function's wiring (saved
    # tensors, gradient order, None for mask and scale) against register_autograd's
    monkeypatch.setattr(wac, "eager", wac.eager_on("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback's one-time warning
        _eager_vs_op("cpu", torch.float32, monkeypatch, exact_bias=True)


def test_eager_path_is_skipped_under_tracing_and_for_cpu():
    q = torch.randn(1, 1, 4, 32)
    assert not wac.eager(q)  # CPU: the op (its reference)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not wac.eager_on("cpu")(torch.empty(1))


def test_cached_plan_needs_the_same_metadata():
    # a plan is keyed on every input's shape, strides, dtype and device: anything else is a miss
    q, k, v, bias, mask = inputs(4, 2, 49, 32, 2, dtype=torch.float16)
    x = ("base", False)
    key = wac._plan_key("mma", False, q, k, v, bias, mask, x)
    assert key == wac._plan_key("mma", False, q.clone(), k, v, bias, mask, x)
    for other in (
        wac._plan_key("mma", True, q, k, v, bias, mask, ("base", q, None)),
        wac._plan_key("mma", False, q, k, v, bias, None, x),
        wac._plan_key("mma", False, q, k.transpose(2, 3), v, bias, mask, x),
        wac._plan_key("mma", False, q, k, v, bias.float(), mask, x),
        wac._plan_key("scalar", False, q, k, v, bias, mask, x),
        wac._plan_key("mma", False, q, k, v, bias, mask, ("ldm", False)),
        wac._plan_key("mma", False, q, k, v, bias, mask, ("base", True)),
    ):
        assert other != key


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_path_matches_op_path_cuda(dtype, monkeypatch):
    _eager_vs_op("cuda", dtype, monkeypatch, exact_bias=False)
