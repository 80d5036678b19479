"""aiak::window_attention, roll_window_partition, window_merge_roll and aiak.ops.swin.convert.

CPU: the reference against a literal float64 implementation, gradients (gradcheck), input
errors, the fallback path, opcheck, torch.compile, autocast and pure-half models through
``convert`` on a module written with timm's attribute names. ``cuda``: the kernels against the
reference, and a real timm model when timm is installed.
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings

import pytest
import torch
from torch import nn

import aiak.ops  # noqa: F401
from aiak.ops import _window_attention_cuda as wac
from aiak.ops import _window_attention_ref as war
from aiak.ops import swin
from aiak.ops import window_partition as wp
from aiak.ops.window_attention import roll_window_partition, window_attention, window_merge_roll

# the module, not the function aiak.ops exports under the same name
wa = importlib.import_module("aiak.ops.window_attention")

# ------------------------------------------------------------------------------------------
# literal float64 implementations, loop by loop
# ------------------------------------------------------------------------------------------


def literal_attention(q, k, v, bias, mask, scale):
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    out = torch.empty_like(q)
    windows, heads, _n, _ = q.shape
    for b in range(windows):
        for h in range(heads):
            s = scale * q[b, h] @ k[b, h].T + bias[h]
            if mask is not None:
                s = s + mask[b % mask.shape[0]].double()
            out[b, h] = torch.softmax(s, -1) @ v[b, h]
    return out


def literal_partition(x, ws, shift):
    b, h, w, _c = x.shape
    out = []
    for bi in range(b):
        for wh in range(h // ws):
            for ww in range(w // ws):
                tokens = [
                    x[bi, (wh * ws + r + shift) % h, (ww * ws + cc + shift) % w]
                    for r in range(ws)
                    for cc in range(ws)
                ]
                out.append(torch.stack(tokens))
    return torch.stack(out)


def swin_mask(h, w, ws, shift):
    """Swin's shifted-window mask (0 / -100), [nW, ws*ws, ws*ws]."""
    img = torch.zeros(1, h, w, 1)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    win = literal_partition(img, ws, 0).view(-1, ws * ws)
    diff = win.unsqueeze(1) - win.unsqueeze(2)
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


def inputs(windows, heads, n, d, nw=None, dtype=torch.float64, device="cpu", gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    q, k, v = (torch.randn(windows, heads, n, d, generator=g).to(device, dtype) for _ in "qkv")
    bias = torch.randn(heads, n, n, generator=g).to(device, dtype)
    mask = None
    if nw is not None:
        mask = torch.where(torch.rand(nw, n, n, generator=g) < 0.3, -100.0, 0.0).to(device)
    return q, k, v, bias, mask


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
    assert (out.double() - exact).norm() / exact.norm() < 4e-3


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
    assert max(wac._mma_smem_bytes(d, b) for d in (32, 64) for b in (False, True)) < 227 * 1024
    x = torch.randn(4, 3, 49, 3, 32, dtype=torch.float16).permute(3, 0, 1, 2, 4)[0]
    assert wac._mma_ready(x) is x  # timm's qkv view: aligned, 8-element strides, no copy
    odd = torch.randn(4 * 3 * 49 * 33 + 1, dtype=torch.float16)[1:].view(4, 3, 49, 33)[..., :32]
    fixed = wac._mma_ready(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    assert fixed.data_ptr() % 16 == 0


@pytest.mark.parametrize("regs", [80, 168, 234])
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


def _opcheck_samples(device, dtype):
    q, k, v, bias, mask = inputs(4, 2, 7, 32, 2, dtype=dtype, device=device)
    strided = torch.randn(4, 7, 3, 2, 32, dtype=dtype, device=device).permute(2, 0, 3, 1, 4)
    qs, ks, vs = strided.unbind(0)
    return [
        (q, k, v, bias, mask, 0.3),
        (q, k, v, bias, None, 0.3),
        (qs, ks, vs, bias, mask, 0.2),
    ]


def _opcheck_all(device, dtype):
    for q, k, v, bias, mask, scale in _opcheck_samples(device, dtype):
        grads = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        torch.library.opcheck(torch.ops.aiak.window_attention.default, (*grads, mask, scale))
        dout = torch.randn_like(q)
        torch.library.opcheck(
            torch.ops.aiak.window_attention_backward.default, (dout, q, k, v, bias, mask, scale)
        )
    x = torch.randn(2, 14, 7, 6, dtype=dtype, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.aiak.roll_window_partition.default, (x, 7, 3))
    w = torch.randn(4, 49, 6, dtype=dtype, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.aiak.window_merge_roll.default, (w, 14, 7, 3))


def test_opcheck_cpu():
    _opcheck_all("cpu", torch.float32)


# ------------------------------------------------------------------------------------------
# convert() on modules written with timm's attribute names and maths
# ------------------------------------------------------------------------------------------


def rel_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = coords.flatten(1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[:, :, 0] * (2 * ws - 1) + rel[:, :, 1]


class WindowAttention(nn.Module):
    """timm's attribute names, the stock (unfused) maths."""

    def __init__(self, dim, heads, ws, attn_drop=0.0):
        super().__init__()
        self.num_heads, self.window_size, self.scale = heads, (ws, ws), (dim // heads) ** -0.5
        self.window_area = ws * ws
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads))
        self.register_buffer("relative_position_index", rel_index(ws), persistent=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop, self.proj_drop = nn.Dropout(attn_drop), nn.Dropout(0.0)

    def forward(self, x, mask=None):
        b_, n, _c = x.shape
        q, k, v = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        attn = attn + bias.view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(-1, nw, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = self.attn_drop(attn.softmax(-1))
        return self.proj_drop(self.proj((attn @ v).transpose(1, 2).reshape(b_, n, -1)))


class SwinTransformerBlock(nn.Module):
    def __init__(self, dim, heads, res, ws, shift, attn_drop=0.0):
        super().__init__()
        self.window_size, self.shift_size = (ws, ws), (shift, shift)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, ws, attn_drop)
        self.register_buffer("attn_mask", swin_mask(res, res, ws, shift) if shift else None)

    def _attn(self, x):
        b, h, w, c = x.shape
        s, ws = self.shift_size[0], self.window_size[0]
        x = torch.roll(x, (-s, -s), (1, 2)) if s else x
        win = (
            x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        )
        win = self.attn(win, mask=self.attn_mask)
        x = win.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return torch.roll(x, (s, s), (1, 2)) if s else x

    def forward(self, x):
        return x + self._attn(self.norm1(x))


class TinySwin(nn.Module):
    def __init__(self, dim=64, heads=2, res=14, ws=7, attn_drop=0.0):
        super().__init__()
        self.blocks = nn.Sequential(
            SwinTransformerBlock(dim, heads, res, ws, 0, attn_drop),
            SwinTransformerBlock(dim, heads, res, ws, ws // 2, attn_drop),
        )
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean((1, 2)))


def _pair_models(**kw):
    torch.manual_seed(0)
    ref = TinySwin(**kw)
    conv = TinySwin(**kw)
    conv.load_state_dict(ref.state_dict())
    return ref, swin.convert(conv)


def test_convert_replaces_modules_and_keeps_state_dict():
    ref, conv = _pair_models()
    assert sum(isinstance(m, swin.FusedWindowAttention) for m in conv.modules()) == 2
    assert ref.state_dict().keys() == conv.state_dict().keys()
    assert all(hasattr(b, "_aiak_timm_attn") for b in conv.blocks)


def test_convert_matches_original_forward_and_backward():
    ref, conv = _pair_models()
    x = torch.randn(3, 14, 14, 64)
    out_r, out_c = ref(x), conv(x)
    torch.testing.assert_close(out_c, out_r, rtol=1e-4, atol=1e-5)
    out_r.square().sum().backward()
    out_c.square().sum().backward()
    grads_r = dict(ref.named_parameters())
    for name, p in conv.named_parameters():
        torch.testing.assert_close(p.grad, grads_r[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_convert_leaves_attention_dropout_unfused():
    with pytest.warns(RuntimeWarning, match="attention dropout"):
        _, conv = _pair_models(attn_drop=0.1)
    assert not any(isinstance(m, swin.FusedWindowAttention) for m in conv.modules())
    with pytest.raises(TypeError, match=r"nn\.Module"):
        swin.convert("model")


def test_convert_under_autocast_o1_cpu():
    ref, conv = _pair_models()
    x = torch.randn(2, 14, 14, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_r, out_c = ref(x), conv(x)
    assert out_c.dtype == out_r.dtype
    assert (out_c.float() - out_r.float()).norm() / out_r.float().norm() < 2e-2
    out_c.float().sum().backward()
    table = conv.blocks[0].attn.relative_position_bias_table
    assert table.grad is not None and table.grad.dtype == torch.float32


def test_convert_pure_half_cpu():
    ref, conv = _pair_models()
    ref, conv = ref.to(torch.bfloat16), conv.to(torch.bfloat16)
    x = torch.randn(2, 14, 14, 64, dtype=torch.bfloat16)
    out_r, out_c = ref(x), conv(x)
    assert out_c.dtype == torch.bfloat16
    assert (out_c.float() - out_r.float()).norm() / out_r.float().norm() < 3e-2
    out_c.float().sum().backward()
    assert conv.blocks[1].attn.relative_position_bias_table.grad.dtype == torch.bfloat16


def test_torch_compile_cpu():
    ref, conv = _pair_models()
    x = torch.randn(2, 14, 14, 64)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert conv.blocks[0].attn.relative_position_bias_table.grad is not None


# ------------------------------------------------------------------------------------------
# CUDA: kernels vs the reference
# ------------------------------------------------------------------------------------------

HALF_TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


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


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", wa.KERNEL_CHOICES)
@pytest.mark.parametrize(("windows", "heads", "n", "d", "nw", "dtype"), KERNEL_CASES)
def test_kernel_matches_reference(kernel, windows, heads, n, d, nw, dtype):
    dev = "cuda"
    q, k, v, bias, mask = inputs(windows, heads, n, d, nw, dtype=dtype, device=dev)
    bias = bias.float()
    scale = d**-0.5
    exact = literal_attention(q, k, v, bias, mask, scale) if windows * heads <= 64 else None
    ref = war._attention_reference(q, k, v, bias, mask, scale)
    out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < HALF_TOL[dtype]
    if exact is not None:
        assert _rel(out, exact) < HALF_TOL[dtype]
    dout = torch.randn_like(q)
    got = wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, scale)
    want = war._attention_backward_reference(
        dout.double(), q.double(), k.double(), v.double(), bias.double(), mask, scale
    )
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape and g.dtype == (bias.dtype if name == "dbias" else dtype), name
        assert torch.isfinite(g).all(), name
        assert _rel(g, w) < 2 * HALF_TOL[dtype], name


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", wa.KERNEL_CHOICES)
def test_kernel_reads_unaligned_and_strided_views(kernel):
    # a 2-byte offset into the storage and odd strides: the mma path copies, scalar reads
    base = torch.randn(6 * 3 * 49 * 33 + 1, device="cuda", dtype=torch.float16)
    q = base[1:].view(6, 3, 49, 33)[..., :32]
    k, v = torch.randn(2, 6, 3, 49, 32, device="cuda", dtype=torch.float16).unbind(0)
    bias = torch.randn(3, 49, 49, device="cuda")
    mask = torch.where(torch.rand(2, 49, 49, device="cuda") < 0.3, -100.0, 0.0)
    out = wac._attention_cuda_with(kernel, q, k, v, bias, mask, 0.2)
    ref = war._attention_reference(q.contiguous(), k, v, bias, mask, 0.2)
    assert _rel(out, ref) < HALF_TOL[torch.float16]
    dout = torch.randn(6, 3, 49, 32, device="cuda", dtype=torch.float16)
    got = wac._attention_backward_cuda_with(kernel, dout, q, k, v, bias, mask, 0.2)
    want = war._attention_backward_reference(dout, q.contiguous(), k, v, bias, mask, 0.2)
    for g, w in zip(got, want):
        assert _rel(g, w) < 2 * HALF_TOL[torch.float16]


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


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["o1", "pure_half"])
def test_convert_on_cuda_autocast_and_pure_half(mode):
    ref, conv = _pair_models()
    ref, conv = ref.cuda(), conv.cuda()
    x = torch.randn(4, 14, 14, 64, device="cuda")
    if mode == "pure_half":
        ref, conv, x = ref.half(), conv.half(), x.half()
        out_r, out_c = ref(x), conv(x)
    else:
        with torch.autocast("cuda", dtype=torch.float16):
            out_r, out_c = ref(x), conv(x)
    assert _rel(out_c, out_r) < 1e-2
    out_r.float().square().sum().backward()
    out_c.float().square().sum().backward()
    grads_r = dict(ref.named_parameters())
    for name, p in conv.named_parameters():
        assert _rel(p.grad, grads_r[name].grad) < 5e-2, name


@pytest.mark.cuda
def test_timm_swin_tiny_convert():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).cuda().eval()
    conv = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).cuda().eval()
    conv.load_state_dict(ref.state_dict())
    swin.convert(conv)
    n_fused = sum(isinstance(m, swin.FusedWindowAttention) for m in conv.modules())
    assert n_fused == 12  # depths 2 + 2 + 6 + 2
    x = torch.randn(2, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out_r, out_c = ref(x), conv(x)
    assert _rel(out_c, out_r) < 1e-2
    conv.train()
    with torch.autocast("cuda", dtype=torch.float16):
        conv(x).float().sum().backward()
    grads = [p.grad for p in conv.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


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


def _both_paths(fn, leaves, grad):
    """(outputs, grads) of ``fn`` on fresh copies of ``leaves``, backward with ``grad``."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves]


def _eager_vs_op(device, dtype, monkeypatch, exact_bias):
    q, k, v, bias, mask = inputs(8, 3, 49, 32, 4, dtype=dtype, device=device)
    bias = bias.float()
    dout = torch.randn_like(q)
    calls = []
    real = wa._EagerAttention.apply
    monkeypatch.setattr(wa._EagerAttention, "apply", lambda *a: calls.append(1) or real(*a))
    eager = _both_paths(lambda *t: window_attention(*t, mask, 0.2), (q, k, v, bias), dout)
    assert calls, "the eager path did not run"
    op = _both_paths(lambda *t: wa.ATTENTION_OP.overload(*t, mask, 0.2), (q, k, v, bias), dout)
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
    key = wac._plan_key("mma", False, q, k, v, bias, mask)
    assert key == wac._plan_key("mma", False, q.clone(), k, v, bias, mask)
    for other in (
        wac._plan_key("mma", True, q, k, v, bias, mask),
        wac._plan_key("mma", False, q, k, v, bias, None),
        wac._plan_key("mma", False, q, k.transpose(2, 3), v, bias, mask),
        wac._plan_key("mma", False, q, k, v, bias.float(), mask),
        wac._plan_key("scalar", False, q, k, v, bias, mask),
    ):
        assert other != key


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_path_matches_op_path_cuda(dtype, monkeypatch):
    _eager_vs_op("cuda", dtype, monkeypatch, exact_bias=False)
