"""Window attention's input checks, PyTorch references and fakes (every path checks the same).

The references compute in fp32 for half inputs (float64 stays float64); the fakes give
``torch.compile`` the output metadata. The CUDA launchers are in ``_window_attention_cuda``.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_TOKENS = 64
HEAD_DIMS = (32, 64)


def _check_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    tokens_first: bool = False,
) -> None:
    op = "window_attention"
    named = [("q", q), ("k", k), ("v", v), ("bias", bias)]
    if mask is not None:
        named.append(("mask", mask))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected a floating dtype")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B*nW, nH, N, D], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but q has {q.dtype}")
    windows, heads, n, _ = q.shape
    if tuple(bias.shape) != (heads, n, n):
        raise ValueError(
            f"{op}: bias must be [nH, N, N] = {(heads, n, n)}, got {tuple(bias.shape)}"
        )
    if mask is not None:
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (n, n) or mask.shape[0] == 0:
            raise ValueError(f"{op}: mask must be [nW, N, N] with N = {n}, got {tuple(mask.shape)}")
        if windows % mask.shape[0] != 0:
            raise ValueError(
                f"{op}: mask has {mask.shape[0]} windows, which does not divide q's "
                f"B*nW = {windows}"
            )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a number, got {type(scale).__name__}")
    if not isinstance(tokens_first, bool):
        raise TypeError(f"{op}: tokens_first must be a bool, got {type(tokens_first).__name__}")


def _shape_reasons(q: torch.Tensor) -> list[str]:
    n, d = q.shape[-2], q.shape[-1]
    reasons = []
    if n > MAX_TOKENS:
        reasons.append(f"window_attention: N = {n} tokens per window > {MAX_TOKENS}")
    if d not in HEAD_DIMS:
        reasons.append(f"window_attention: head_dim {d} not in {HEAD_DIMS}")
    return reasons


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    ct = _compute_dtype(q)
    windows, heads, n, _ = q.shape
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-2, -1)) * scale + bias.to(ct)
    if mask is not None:
        nw = mask.shape[0]
        s = (s.view(windows // nw, nw, heads, n, n) + mask.to(ct)[None, :, None]).view(s.shape)
    return torch.softmax(s, dim=-1)


def _attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    tokens_first: bool = False,
) -> torch.Tensor:
    _check_attention(q, k, v, bias, mask, scale, tokens_first)
    p = _probabilities(q, k, bias, mask, scale)
    out = torch.matmul(p, v.to(p.dtype))
    if tokens_first:
        out = out.transpose(1, 2)
    return out.to(q.dtype).contiguous()


def _check_grad(dout: torch.Tensor, q: torch.Tensor) -> None:
    """The backward's ``grad``: q's shape, any strides (a transposed view of the gradient of a
    ``tokens_first`` output is read in place)."""
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"window_attention: grad must be a Tensor, got {type(dout).__name__}")
    if dout.shape != q.shape:
        raise ValueError(
            f"window_attention: grad has shape {tuple(dout.shape)}, not {tuple(q.shape)}"
        )


def _attention_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_attention(q, k, v, bias, mask, scale)
    _check_grad(dout, q)
    p = _probabilities(q, k, bias, mask, scale)
    ct = p.dtype
    do = dout.to(ct)
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.to(ct).transpose(-2, -1))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(ct)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(ct)) * scale
    dbias = ds.sum(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias.to(bias.dtype)


def _attention_fake(q, k, v, bias, mask, scale, tokens_first=False):
    _check_attention(q, k, v, bias, mask, scale, tokens_first)
    windows, heads, n, d = q.shape
    shape = (windows, n, heads, d) if tokens_first else (windows, heads, n, d)
    return q.new_empty(shape)


def _attention_backward_fake(dout, q, k, v, bias, mask, scale):
    _check_attention(q, k, v, bias, mask, scale)
    _check_grad(dout, q)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return (*grads, torch.empty_like(bias, memory_format=torch.contiguous_format))
