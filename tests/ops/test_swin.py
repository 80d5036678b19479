"""aiak.ops.swin.convert on modules written with timm's attribute names and maths: state dict,
forward and backward against the original, attention dropout left unfused, autocast and pure
half, torch.compile; on CUDA the kernels inside converted models, and a real timm Swin-T when
timm is installed."""

from __future__ import annotations

import pytest
import torch
from _numerics import rel_err as _rel
from _window_helpers import Copies
from _window_literal import rel_index, swin_mask
from torch import nn

from aiak.ops import _window_attention_cuda as wac
from aiak.ops import swin
from aiak.ops import window_attention as wa


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


def _copies_in_step(attn: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> int:
    attn.zero_grad(set_to_none=True)  # the same gradient accumulation each time
    with Copies() as copies:
        attn(x, mask).square().sum().backward()
    return copies.count


def _heads_first(q, k, v, bias, mask, scale):
    """The attention core in timm's layout: [B*nW, nH, N, D] out, transposed by the caller."""
    return wa.window_attention(q, k, v, bias, mask, scale)


def test_fused_attention_output_needs_no_layout_copy(monkeypatch):
    # through the op (CPU): the [B*nW, N, nH, D] output makes the module's reshape a view; with
    # the op's default layout the same module pays a transpose copy
    ref, conv = _pair_models()
    attn = conv.blocks[1].attn
    x, mask = torch.randn(8, 49, 64), conv.blocks[1].attn_mask
    fused = _copies_in_step(attn, x, mask)

    def old_layout(qkv, heads, bias, mask, scale):
        q, k, v = wa._split_qkv(qkv, heads)
        return (
            _heads_first(q, k, v, bias, mask, scale).transpose(1, 2).reshape(qkv.shape[0], 49, -1)
        )

    monkeypatch.setattr(swin, "window_attention_qkv", old_layout)
    assert _copies_in_step(attn, x, mask) == fused + 1
    monkeypatch.undo()
    torch.testing.assert_close(attn(x, mask), ref.blocks[1].attn(x, mask), rtol=1e-4, atol=1e-5)


def test_fused_attention_kernel_path_copies_nothing(recorder, monkeypatch):
    # the kernels' path (launches recorded, CPU tensors): q, k, v read in place, the output in
    # proj's layout, dq/dk/dv written into one gradient of qkv; the one copy left is autograd's
    # of the bias table's transposed gradient (`relative_position_bias`), as without aiak
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(wac, "_sm_limits", lambda device: (228 * 1024, 65536))
    monkeypatch.setattr(wac, "_PLANS", {})
    monkeypatch.setattr(wac, "use_kernel", lambda *a, **k: True)
    # the eager path even under the counting mode
    monkeypatch.setattr(wac, "eager", lambda t: type(t) in (torch.Tensor, nn.Parameter))
    _, conv = _pair_models()
    attn, mask = conv.blocks[1].attn, conv.blocks[1].attn_mask
    attn.qkv.half(), attn.proj.half()  # fp16 q/k/v, fp32 bias and mask: as under autocast
    x = torch.randn(8, 49, 64).half()
    packed = _copies_in_step(attn, x, mask)
    assert packed == 1
    launched = [launch["name"] for launch in recorder.launches]
    bwd = wa.BWD_VARIANTS[wa.DEFAULT_BWD_VARIANT].infix  # the default backward variant
    assert launched == [
        "window_attention_mma_fwd_f16_d32",
        f"window_attention_mma_bwd_{bwd}f16_d32",
    ]
    # the unpacked path (the op's autograd of q, k, v views) stacks and copies back
    monkeypatch.setattr(wac, "eager", lambda t: False)
    assert _copies_in_step(attn, x, mask) >= packed + 2


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


def test_converted_model_pickles_and_deep_copies():
    import copy
    import io

    _, conv = _pair_models()
    x = torch.randn(2, 14, 14, 64)
    want = conv(x)
    buf = io.BytesIO()
    torch.save(conv, buf)  # the converted _attn methods pickle with their blocks
    buf.seek(0)
    for again in (torch.load(buf, weights_only=False), copy.deepcopy(conv)):
        torch.testing.assert_close(again(x), want)
        block = next(m for m in again.modules() if hasattr(m, "_aiak_timm_attn"))
        assert block._attn.module is block  # bound to the copy, not the original


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
    assert _rel(out_c, out_r) < 2e-2
    out_c.float().sum().backward()
    table = conv.blocks[0].attn.relative_position_bias_table
    assert table.grad is not None and table.grad.dtype == torch.float32


def test_convert_pure_half_cpu():
    ref, conv = _pair_models()
    ref, conv = ref.to(torch.bfloat16), conv.to(torch.bfloat16)
    x = torch.randn(2, 14, 14, 64, dtype=torch.bfloat16)
    out_r, out_c = ref(x), conv(x)
    assert out_c.dtype == torch.bfloat16
    assert _rel(out_c, out_r) < 3e-2
    out_c.float().sum().backward()
    assert conv.blocks[1].attn.relative_position_bias_table.grad.dtype == torch.bfloat16


def test_compiled_block_keeps_partition_for_inductor(monkeypatch):
    """Compiled, a converted block partitions with torch ops (inductor fuses them) and still
    runs the fused attention op; eager, it uses the gather ops."""
    from aiak.ops import window_attention as wa

    _, conv = _pair_models()
    calls = {"partition": 0}
    real = wa.roll_window_partition

    def counting(*args, **kwargs):
        calls["partition"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(swin, "roll_window_partition", counting)
    x = torch.randn(2, 14, 14, 64)
    conv(x)
    assert calls["partition"] == 2
    calls["partition"] = 0
    gm_ops: list[str] = []

    def backend(gm, inputs):
        gm_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(conv, fullgraph=True, backend=backend)(x)
    assert calls["partition"] == 0
    assert any("window_attention" in t for t in gm_ops)
    assert not any("window_partition" in t for t in gm_ops)


def test_torch_compile_cpu():
    ref, conv = _pair_models()
    x = torch.randn(2, 14, 14, 64)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert conv.blocks[0].attn.relative_position_bias_table.grad is not None


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
