"""Models built from torch.nn alone, for the recipes' ``--tiny`` runs, the compile tests and
``benchmarks/bench_e2e.py --quick`` (machines without timm or torchvision).

- :class:`SwinLike`: Swin blocks with timm's attribute names and maths (``WindowAttention``
  with ``qkv``/``proj``/``relative_position_bias_table``/``relative_position_index``,
  ``SwinTransformerBlock`` with ``_attn``, ``window_size``, ``shift_size``, ``attn_mask``), so
  ``aiak.ops.swin.convert`` recognises and converts it as it does timm's Swin.
- :class:`ResNetLike`: basic residual blocks with BatchNorm.
- :func:`encoder`: ``nn.TransformerEncoder`` with a classification head (BERT-like when sized
  up: ``encoder(768, 12, 12)`` is BERT-base's shape).
- :class:`TinyDetector`: a small conv backbone and a YOLOX-style decoupled head whose
  ``forward`` returns YOLOX's decoded ``[B, A, 5 + C]`` outputs.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNetLike", "SwinLike", "TinyDetector", "encoder", "relative_index", "shift_mask"]


def relative_index(ws: int) -> torch.Tensor:
    """Swin's relative position index, ``[ws*ws, ws*ws]`` into a ``(2ws-1)^2`` table."""
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = coords.flatten(1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[:, :, 0] * (2 * ws - 1) + rel[:, :, 1]


def _partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    return x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)


def _merge(win: torch.Tensor, b: int, h: int, w: int, ws: int) -> torch.Tensor:
    c = win.shape[-1]
    return win.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def shift_mask(h: int, w: int, ws: int, shift: int) -> torch.Tensor:
    """Swin's shifted-window mask (0 / -100), ``[nW, ws*ws, ws*ws]``."""
    img = torch.zeros(1, h, w, 1)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    win = _partition(img, ws).squeeze(-1)
    diff = win.unsqueeze(1) - win.unsqueeze(2)
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


class WindowAttention(nn.Module):
    """timm's WindowAttention: attribute names and the stock (unfused) maths."""

    def __init__(self, dim: int, heads: int, ws: int) -> None:
        super().__init__()
        self.num_heads, self.window_size, self.scale = heads, (ws, ws), (dim // heads) ** -0.5
        self.window_area = ws * ws
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * ws - 1) ** 2, heads) * 0.02
        )
        self.register_buffer("relative_position_index", relative_index(ws), persistent=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop, self.proj_drop = nn.Dropout(0.0), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
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
    """timm's block: LayerNorm, (shifted) window attention, LayerNorm, MLP; x ``[B, H, W, C]``."""

    def __init__(self, dim: int, heads: int, res: int, ws: int, shift: int) -> None:
        super().__init__()
        self.window_size, self.shift_size = (ws, ws), (shift, shift)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, ws)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("attn_mask", shift_mask(res, res, ws, shift) if shift else None)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, _c = x.shape
        s, ws = self.shift_size[0], self.window_size[0]
        x = torch.roll(x, (-s, -s), (1, 2)) if s else x
        win = self.attn(_partition(x, ws), mask=self.attn_mask)
        x = _merge(win, b, h, w, ws)
        return torch.roll(x, (s, s), (1, 2)) if s else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SwinLike(nn.Module):
    """Patch embedding, ``depth`` pairs of (plain, shifted) blocks, mean pool, head.
    Input ``[B, 3, H, W]`` with ``H = W = patch * res``."""

    def __init__(
        self,
        dim: int = 32,
        heads: int = 2,
        res: int = 8,
        ws: int = 4,
        depth: int = 1,
        patch: int = 4,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm0 = nn.LayerNorm(dim)
        blocks = []
        for _ in range(depth):
            blocks += [
                SwinTransformerBlock(dim, heads, res, ws, 0),
                SwinTransformerBlock(dim, heads, res, ws, ws // 2),
            ]
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm0(self.patch_embed(x).permute(0, 2, 3, 1))
        return self.head(self.norm(self.blocks(x)).mean((1, 2)))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: its attribute names and forward (``aiak.ops.resnet.convert``
    recognises it)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


class ResNetLike(nn.Module):
    """Stem, one basic block per width (stride 2 after the first), pool, head."""

    def __init__(self, widths: tuple[int, ...] = (8, 16), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class _Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int, vocab: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(tokens)))[:, 0])


def encoder(
    dim: int = 32, heads: int = 2, layers: int = 2, vocab: int = 100, classes: int = 10
) -> nn.Module:
    """Token ids ``[B, L]`` -> class logits ``[B, classes]`` (first token's state)."""
    return _Encoder(dim, heads, layers, vocab, classes)


class TinyDetector(nn.Module):
    """A small conv backbone (strides 8 and 16) and a YOLOX-style decoupled head.

    ``forward(images)`` returns YOLOX's training outputs, decoded: ``[B, A, 5 + C]`` with
    ``cx, cy, w, h`` in pixels, the objectness logit and the class logits; ``anchors(h, w)``
    gives the matching anchor centres and strides."""

    strides = (8, 16)

    def __init__(self, classes: int = 4, width: int = 16) -> None:
        super().__init__()

        def conv(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU()
            )

        self.stem = nn.Sequential(conv(3, width, 2), conv(width, width, 2))
        self.c3 = conv(width, 2 * width, 2)  # stride 8
        self.c4 = conv(2 * width, 2 * width, 2)  # stride 16
        self.cls = nn.ModuleList(nn.Conv2d(2 * width, classes, 1) for _ in self.strides)
        self.reg = nn.ModuleList(nn.Conv2d(2 * width, 4, 1) for _ in self.strides)
        self.obj = nn.ModuleList(nn.Conv2d(2 * width, 1, 1) for _ in self.strides)

    def anchors(self, h: int, w: int, device: torch.device | str = "cpu") -> tuple:
        centers, strides = [], []
        for s in self.strides:
            ys, xs = torch.meshgrid(
                torch.arange(h // s, device=device), torch.arange(w // s, device=device),
                indexing="ij",
            )  # fmt: skip
            centers.append(torch.stack([xs, ys], -1).reshape(-1, 2).float().add(0.5).mul(s))
            strides.append(torch.full((centers[-1].shape[0],), float(s), device=device))
        return torch.cat(centers), torch.cat(strides)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f3 = self.c3(self.stem(images))
        feats = (f3, self.c4(f3))
        outs = []
        for i, (f, s) in enumerate(zip(feats, self.strides)):
            _, _, h, w = f.shape
            ys, xs = torch.meshgrid(
                torch.arange(h, device=f.device), torch.arange(w, device=f.device), indexing="ij"
            )
            grid = torch.stack([xs, ys], -1).reshape(1, -1, 2).to(f.dtype)
            reg = self.reg[i](f).flatten(2).transpose(1, 2)
            xy = (reg[..., :2] + grid + 0.5) * s
            wh = reg[..., 2:].clamp(max=8.0).exp() * s
            obj = self.obj[i](f).flatten(2).transpose(1, 2)
            cls = self.cls[i](f).flatten(2).transpose(1, 2)
            outs.append(torch.cat([xy, wh, obj, cls], -1))
        return torch.cat(outs, 1)
