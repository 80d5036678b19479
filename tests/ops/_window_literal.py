"""Literal float64 implementations of Swin's window attention, window partition, shift mask
and relative-position index, loop by loop: the ground truth of tests/ops/test_window_attention.py
and tests/ops/test_swin.py."""

from __future__ import annotations

import torch


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


def rel_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = coords.flatten(1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[:, :, 0] * (2 * ws - 1) + rel[:, :, 1]
