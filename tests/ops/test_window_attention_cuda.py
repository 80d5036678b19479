"""aiak::window_attention's CUDA kernels (both pairs, every variant) against the reference,
the packed-qkv gradient, the kernel switch, the partition kernels and opcheck on CUDA; the CPU
side is test_window_attention.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from _numerics import rel_err as _rel
from _window_helpers import both_paths as _both_paths
from _window_helpers import opcheck_all as _opcheck_all
from _window_literal import inputs, literal_attention

import aiak.ops  # noqa: F401
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import _window_attention_ref as war
from aiak.ops import window_partition as wp
from aiak.ops.window_attention import roll_window_partition, window_attention, window_merge_roll

# the module, not the function aiak.ops exports under the same name
wa = importlib.import_module("aiak.ops.window_attention")


HALF_TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
# every kernel: (pair, mma forward variant, mma backward variant), each variant at least once
KERNEL_VARIANTS = (
    [("scalar", "base", "base")]
    + [("mma", "base", v) for v in wa.BWD_VARIANTS]
    + [("mma", f, "base") for f in wa.FWD_VARIANTS if f != "base"]
)


# every Swin-T stage (heads, windows per image, an odd batch) with and without the mask in fp16
# and bf16; then the benchmark's stage-1 batch-64 shape (4096 windows: every mma block loops
# over many windows and sums their bias gradients), D = 64, N = 64 and odd N
SWIN_T_STAGES = ((3, 64, 3), (6, 16, 5), (12, 4, 7), (24, 1, 9))
KERNEL_CASES = [
    (batch * nw, heads, 49, 32, nw if masked else None, dtype)
    for heads, nw, batch in SWIN_T_STAGES
    for masked in (True, False)
    for dtype in (torch.float16, torch.bfloat16)
] + [
    (64 * 64, 3, 49, 32, 64, torch.float16),
    (40, 4, 64, 64, 4, torch.float16),
    (9, 2, 64, 64, None, torch.bfloat16),
    (7, 3, 49, 64, 7, torch.bfloat16),
    (9, 2, 64, 32, None, torch.bfloat16),
    (5, 3, 1, 64, None, torch.float16),
    (7, 2, 13, 32, 7, torch.float16),
    (11, 2, 33, 32, None, torch.bfloat16),
]
# the variants against base: the largest grid and the odd token counts
VARIANT_CASES = [
    c for c in KERNEL_CASES if c[0] == 64 * 64 or c[2:4] in ((64, 64), (13, 32), (33, 32))
]


@pytest.mark.cuda
@pytest.mark.parametrize(("kernel", "fwd", "variant"), KERNEL_VARIANTS)
@pytest.mark.parametrize(("windows", "heads", "n", "d", "nw", "dtype"), KERNEL_CASES)
def test_kernel_matches_reference(kernel, fwd, variant, windows, heads, n, d, nw, dtype):
    dev = "cuda"
    q, k, v, bias, mask = inputs(windows, heads, n, d, nw, dtype=dtype, device=dev)
    bias = bias.float()
    scale = d**-0.5
    exact = literal_attention(q, k, v, bias, mask, scale) if windows * heads <= 64 else None
    ref = war._attention_reference(q, k, v, bias, mask, scale)
    out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, scale, variant=fwd)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < HALF_TOL[dtype]
    if exact is not None:
        assert _rel(out, exact) < HALF_TOL[dtype]
    dout = torch.randn_like(q)
    got = wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale, variant)
    want = war._attention_backward_reference(
        dout.double(), q.double(), k.double(), v.double(), bias.double(), mask, scale
    )
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape and g.dtype == (bias.dtype if name == "dbias" else dtype), name
        assert torch.isfinite(g).all(), name
        assert _rel(g, w) < 2 * HALF_TOL[dtype], name


@pytest.mark.cuda
@pytest.mark.parametrize(("kernel", "fwd", "variant"), KERNEL_VARIANTS)
def test_kernel_reads_unaligned_and_strided_views(kernel, fwd, variant):
    # a 2-byte offset into the storage and odd strides: the mma path copies, scalar reads
    base = torch.randn(6 * 3 * 49 * 33 + 1, device="cuda", dtype=torch.float16)
    q = base[1:].view(6, 3, 49, 33)[..., :32]
    k, v = torch.randn(2, 6, 3, 49, 32, device="cuda", dtype=torch.float16).unbind(0)
    bias = torch.randn(3, 49, 49, device="cuda")
    mask = torch.where(torch.rand(2, 49, 49, device="cuda") < 0.3, -100.0, 0.0)
    out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.2, variant=fwd)
    ref = war._attention_reference(q.contiguous(), k, v, bias, mask, 0.2)
    assert _rel(out, ref) < HALF_TOL[torch.float16]
    dout = torch.randn(6, 3, 49, 32, device="cuda", dtype=torch.float16)
    got = wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, 0.2, variant)
    want = war._attention_backward_reference(dout, q.contiguous(), k, v, bias, mask, 0.2)
    for g, w in zip(got, want):
        assert _rel(g, w) < 2 * HALF_TOL[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize(("kernel", "fwd", "variant"), KERNEL_VARIANTS)
def test_kernel_tokens_first_output_and_strided_grads(kernel, fwd, variant):
    # the [B_, N, nH, D] output is the default one transposed, bit for bit; the backward reads
    # a transposed grad in place (aligned) or through a copy (odd strides), same numbers
    windows, heads, n, d = 16, 3, 49, 32
    x = torch.randn(windows, n, 3, heads, d, device="cuda", dtype=torch.float16)
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(heads, n, n, device="cuda")
    mask = torch.where(torch.rand(4, n, n, device="cuda") < 0.3, -100.0, 0.0)
    out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.2, variant=fwd)
    out_t = wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.2, True, fwd)
    assert out_t.shape == (windows, n, heads, d) and torch.equal(out_t, out.transpose(1, 2))
    dense = torch.randn(windows, heads, n, d, device="cuda", dtype=torch.float16)
    want = wac._attention_backward_cuda_with(kernel, dense, q, k, v, bias, mask, 0.2, variant)
    odd = torch.empty(windows, n, heads, d + 1, device="cuda", dtype=torch.float16)[..., :d]
    for grad in (dense.transpose(1, 2).contiguous().transpose(1, 2), odd.transpose(1, 2)):
        grad.copy_(dense)
        got = wac._attention_backward_cuda_with(kernel, grad, q, k, v, bias, mask, 0.2, variant)
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
            if name == "dbias":  # fp32 atomics: the order of the sums varies by run
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [v for v in wa.BWD_VARIANTS if v != "base"])
@pytest.mark.parametrize(("windows", "heads", "n", "d", "nw", "dtype"), VARIANT_CASES)
def test_bwd_variants_compute_what_base_computes(variant, windows, heads, n, d, nw, dtype):
    # the same products in the same order: dq, dk, dv bit for bit; the bias gradient's partial
    # sums follow each variant's grid (fp32 atomics), so it matches to rounding
    q, k, v, bias, mask = inputs(windows, heads, n, d, nw, dtype=dtype, device="cuda")
    bias, dout, scale = bias.float(), torch.randn_like(q), d**-0.5
    base = wac._attention_backward_cuda_with("mma", dout, q, k, v, bias, mask, scale, "base")
    got = wac._attention_backward_cuda_with("mma", dout, q, k, v, bias, mask, scale, variant)
    for name, a, b in zip(("dq", "dk", "dv"), got, base):
        assert torch.equal(a, b), name
    torch.testing.assert_close(got[3], base[3], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [v for v in wa.FWD_VARIANTS if v != "base"])
@pytest.mark.parametrize(("windows", "heads", "n", "d", "nw", "dtype"), VARIANT_CASES)
def test_fwd_variants_compute_what_base_computes(variant, windows, heads, n, d, nw, dtype):
    q, k, v, bias, mask = inputs(windows, heads, n, d, nw, dtype=dtype, device="cuda")
    bias = bias.float()
    for tokens_first in (False, True):
        base = wac._attention_cuda_with("mma", q, k, v, bias, mask, 0.2, tokens_first, "base")
        got = wac._attention_cuda_with("mma", q, k, v, bias, mask, 0.2, tokens_first, variant)
        assert torch.equal(got, base)


@pytest.mark.cuda
@pytest.mark.parametrize(("kernel", "fwd", "variant"), KERNEL_VARIANTS)
def test_backward_writes_the_gradient_of_packed_qkv(kernel, fwd, variant):
    # dq, dk, dv written through the strides of one [B_, N, 3, nH, D] gradient: the values the
    # backward returns when it allocates them, bit for bit
    windows, heads, n, d = 64, 3, 49, 32
    qkv = torch.randn(windows, n, 3 * heads * d, device="cuda", dtype=torch.float16)
    q, k, v = wa._split_qkv(qkv, heads)
    bias = torch.randn(heads, n, n, device="cuda")
    mask = torch.where(torch.rand(4, n, n, device="cuda") < 0.3, -100.0, 0.0)
    grad = torch.randn(windows, n, heads, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    want = wac._attention_backward_cuda_with(kernel, grad, q, k, v, bias, mask, 0.2, variant)
    dqkv = torch.full_like(qkv, float("nan"))
    out = wa._split_qkv(dqkv, heads)
    got = wac._attention_backward_cuda_with(kernel, grad, q, k, v, bias, mask, 0.2, variant, out)
    assert all(a is b for a, b in zip(got[:3], out))
    assert torch.isfinite(dqkv).all()  # every element written
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_qkv_entry_eager_and_op_paths_agree_on_cuda():
    # the eager Function (gradients written into one dqkv) against the op's autograd (three
    # gradients stacked by autograd): the same kernels, the same numbers
    qkv = torch.randn(32, 49, 3 * 3 * 32, device="cuda", dtype=torch.float16)
    bias = torch.randn(3, 49, 49, device="cuda")
    mask = torch.where(torch.rand(4, 49, 49, device="cuda") < 0.3, -100.0, 0.0)
    grad = torch.randn(32, 49, 96, device="cuda", dtype=torch.float16)
    calls = []
    real = wa._EagerPackedAttention.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wa._EagerPackedAttention, "apply", lambda *a: calls.append(1) or real(*a))
        eager = _both_paths(
            lambda *t: wa.window_attention_qkv(t[0], 3, t[1], mask), (qkv, bias), grad
        )
    assert calls, "the eager path did not run"

    def op(qkv_, bias_):
        q, k, v = wa._split_qkv(qkv_, 3)
        out = wa.ATTENTION_OP.overload(q, k, v, bias_, mask, 32**-0.5, True)
        return out.reshape(32, 49, 96)

    ref = _both_paths(op, (qkv, bias), grad)
    assert torch.equal(eager[0], ref[0])
    assert torch.equal(eager[1][0], ref[1][0])  # dqkv: written in place vs stacked by autograd
    torch.testing.assert_close(eager[1][1], ref[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_kernel_switch_routes_the_op(monkeypatch):
    q, k, v, bias, mask = inputs(32, 3, 49, 32, 4, dtype=torch.float16, device="cuda")
    bias = bias.float().requires_grad_()
    ref = war._attention_reference(q, k, v, bias, mask, 0.2)
    outs = {}
    for kernel in wa.KERNEL_CHOICES:
        monkeypatch.setenv(wa.KERNEL_ENV, kernel)
        assert wa.attention_kernel(q.device) == kernel  # the GPUs this runs on are sm_80+
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        outs[kernel] = window_attention(*leaves, mask, 0.2)
        outs[kernel].float().square().sum().backward()
        assert _rel(outs[kernel], ref) < HALF_TOL[torch.float16]
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    assert _rel(outs["mma"], outs["scalar"]) < HALF_TOL[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", wa.KERNEL_CHOICES)
def test_kernel_reads_strided_qkv_views(kernel):
    x = torch.randn(32, 49, 3, 3, 32, device="cuda", dtype=torch.float16)
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(3, 49, 49, device="cuda")
    out = wac._attention_cuda_with(kernel, q, k, v, bias, None, 0.2)
    ref = war._attention_reference(q.contiguous(), k.contiguous(), v.contiguous(), bias, None, 0.2)
    assert _rel(out, ref) < HALF_TOL[torch.float16]


@pytest.mark.cuda
def test_kernel_fallbacks_on_cuda():
    q, k, v, bias, mask = inputs(4, 2, 81, 48, 2, dtype=torch.float16, device="cuda")
    with pytest.warns(RuntimeWarning, match="head_dim 48"):
        out = wac._attention_cuda(q, k, v, bias, mask, 0.3)
    torch.testing.assert_close(out, war._attention_reference(q, k, v, bias, mask, 0.3))
    q32, k32, v32, b32, _ = inputs(4, 2, 49, 32, dtype=torch.float32, device="cuda")
    out = window_attention(q32, k32, v32, b32, None, 0.3)
    torch.testing.assert_close(out, war._attention_reference(q32, k32, v32, b32, None, 0.3))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "ws", "shift"), [((3, 56, 56, 96), 7, 3), ((2, 8, 16, 6), 8, 0)])
def test_partition_kernels_exact(dtype, shape, ws, shift):
    x = torch.randn(shape, device="cuda").to(dtype)
    win = roll_window_partition(x, ws, shift)
    torch.testing.assert_close(win, wp._partition_reference(x, ws, shift), rtol=0, atol=0)
    back = window_merge_roll(win, shape[1], shape[2], shift)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    # unaligned rows take the narrow-word path
    y = torch.randn(2, 14, 14, 3, device="cuda").to(dtype)
    torch.testing.assert_close(
        roll_window_partition(y, 7, 3), wp._partition_reference(y, 7, 3), rtol=0, atol=0
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_opcheck_cuda(dtype):
    _opcheck_all("cuda", dtype)
