"""Swin window attention in one kernel per direction, and Swin's roll + window partition.

``aiak::window_attention(q, k, v, bias, mask, scale, tokens_first=False)``: for q/k/v
``[B_, nH, N, D]`` (``B_`` = batch x windows per image), ``bias`` ``[nH, N, N]`` (the relative
position bias, already gathered from its table) and an optional ``mask`` ``[nW, N, N]``
applied to window ``b % nW`` (Swin's shifted-window mask)::

    out = softmax(scale * q @ k^T + bias + mask) @ v

``out`` is ``[B_, nH, N, D]``, or with ``tokens_first`` ``[B_, N, nH, D]`` (the kernel writes
that layout, so Swin's ``out.transpose(1, 2).reshape(B_, N, C)`` becomes a view; the backward
reads the incoming gradient through its strides).

Stock PyTorch (timm's default path) runs this as ten kernels writing the ``[B_, nH, N, N]``
scores to memory several times over; the kernel here keeps scores, softmax and both products
in shared memory, and the backward kernel recomputes the probabilities from q, k, v instead of
storing them. Gradients flow to q, k, v and bias (summed over windows and batch); the mask is a
constant (timm keeps it in a buffer). The CUDA kernel covers fp16/bf16 with N <= 64 and
D in {32, 64}; anything else runs the reference (fp32 arithmetic for half inputs) after a
one-time warning.

``aiak::roll_window_partition(x, window, shift)`` / ``aiak::window_merge_roll(windows, H, W,
shift)``: ``torch.roll(x, (-shift, -shift), (1, 2))`` followed by the window partition, and its
inverse, each one gather kernel (each is the other's gradient).

Modules: this one (public API, op declarations, autograd), ``_window_attention_ref`` (checks,
references, fakes), ``_window_attention_cuda`` (kernel choice, grid sizing, launchers),
``window_partition`` (the two gathers).
"""

from __future__ import annotations

import torch

from aiak.ops import _window_attention_cuda as _wac
from aiak.ops._args import check_float
from aiak.ops._registry import define
from aiak.ops._window_attention_cuda import (
    DEFAULT_KERNEL,
    KERNEL_CHOICES,
    KERNEL_ENV,
    _attention_backward_cuda,
    _attention_cuda,
    attention_kernel,
)
from aiak.ops._window_attention_kernels import (
    BWD_VARIANT_ENV,
    BWD_VARIANTS,
    DEFAULT_BWD_VARIANT,
    DEFAULT_FWD_VARIANT,
    FWD_VARIANT_ENV,
    FWD_VARIANTS,
    bwd_variant,
    fwd_variant,
)
from aiak.ops._window_attention_ref import (
    _attention_backward_fake,
    _attention_backward_reference,
    _attention_fake,
    _attention_reference,
)
from aiak.ops.window_partition import roll_window_partition, window_merge_roll

__all__ = [
    "BWD_VARIANTS",
    "BWD_VARIANT_ENV",
    "DEFAULT_BWD_VARIANT",
    "DEFAULT_FWD_VARIANT",
    "DEFAULT_KERNEL",
    "FWD_VARIANTS",
    "FWD_VARIANT_ENV",
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "attention_kernel",
    "bwd_variant",
    "fwd_variant",
    "roll_window_partition",
    "window_attention",
    "window_attention_qkv",
    "window_merge_roll",
]

ATTENTION_OP = define(
    "window_attention(Tensor q, Tensor k, Tensor v, Tensor bias, Tensor? mask, float scale, "
    "bool tokens_first=False) -> Tensor",
    _attention_reference,
    cuda=_attention_cuda,
    fake=_attention_fake,
    differentiable=True,
)
ATTENTION_BACKWARD_OP = define(
    "window_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor bias, "
    "Tensor? mask, float scale) -> (Tensor, Tensor, Tensor, Tensor)",
    _attention_backward_reference,
    cuda=_attention_backward_cuda,
    fake=_attention_backward_fake,
)


# The autograd formula, written once: what the forward saves, and the gradients from the
# backward op. The registered op runs it through the dispatcher; the eager path (below) runs
# the same functions with the backward op's CUDA kernel called directly.


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, bias, mask, scale, *layout = inputs
    ctx.save_for_backward(q, k, v, bias, mask)
    ctx.scale = scale
    ctx.tokens_first = bool(layout and layout[0])


def _attention_grads(ctx, grad, backward_op):
    q, k, v, bias, mask = ctx.saved_tensors
    if ctx.tokens_first:  # [B_, N, nH, D] -> a [B_, nH, N, D] view, read in place
        grad = grad.transpose(1, 2)
    dq, dk, dv, dbias = backward_op(grad, q, k, v, bias, mask, ctx.scale)
    return dq, dk, dv, dbias, None, None, None


def _attention_backward(ctx, grad):
    return _attention_grads(ctx, grad, torch.ops.aiak.window_attention_backward)


torch.library.register_autograd(
    "aiak::window_attention", _attention_backward, setup_context=_attention_setup
)


class _EagerAttention(torch.autograd.Function):
    """The op's autograd formula with its CUDA kernels called directly: the eager path.

    The same kernels as the op's (so the same numbers), without the dispatcher's per-call
    Python (schema defaults, ``register_autograd``'s wrappers, the backward op's own
    dispatch). ``torch.compile``, fake tensors and ``opcheck`` use the op.
    """

    @staticmethod
    def forward(ctx, *inputs):
        out = _attention_cuda(*inputs)
        _attention_setup(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _attention_grads(ctx, grad, _attention_backward_cuda)


def _checked_scale(named: tuple, mask, scale, head_dim: int) -> float:
    """The wrappers' checks (before the dispatcher's own, unnamed errors); the scale to use."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"window_attention: {name} must be a Tensor, got {type(t).__name__}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"window_attention: mask must be a Tensor or None, got {type(mask).__name__}"
        )
    if scale is None:
        scale = head_dim**-0.5
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        raise ValueError("window_attention: mask must not require grad (it is a constant)")
    # NaN or inf would turn every probability NaN; 0 and negative scales are well defined
    return float(check_float("scale", scale, op="window_attention"))


def _split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[B_, nH, N, D]`` as views of ``[B_, N, 3, nH, D]`` (timm's qkv layout)."""
    windows, n, c3 = qkv.shape
    return qkv.view(windows, n, 3, heads, c3 // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


class _EagerPackedAttention(torch.autograd.Function):
    """:func:`window_attention_qkv` on the eager path: the op's kernels, with dq, dk and dv
    written by the backward kernel straight into one ``[B_, N, 3 * C]`` gradient of qkv (three
    strided views), where autograd would ``stack`` three gradients and copy them back into
    qkv's layout (two copies of the whole of it)."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, scale, heads):
        out = _attention_cuda(*_split_qkv(qkv, heads), bias, mask, scale, True)
        ctx.save_for_backward(qkv, bias, mask)
        ctx.scale, ctx.heads = scale, heads
        return out.view(qkv.shape[0], qkv.shape[1], -1)

    @staticmethod
    def backward(ctx, grad):
        qkv, bias, mask = ctx.saved_tensors
        windows, n, _ = qkv.shape
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        dout = grad.reshape(windows, n, ctx.heads, -1).transpose(1, 2)
        q, k, v = _split_qkv(qkv, ctx.heads)
        out = _split_qkv(dqkv, ctx.heads)
        *_, dbias = _attention_backward_cuda(dout, q, k, v, bias, mask, ctx.scale, out)
        return dqkv, dbias, None, None, None


def window_attention_qkv(
    qkv: torch.Tensor,
    heads: int,
    bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Swin's attention core from the qkv projection's output: ``qkv`` ``[B*nW, N, 3 * C]``
    (q, k, v one after the other, heads within each, as timm's ``qkv`` linear writes them),
    ``heads`` of ``C / heads`` channels; returns ``[B*nW, N, C]`` (heads side by side, what
    Swin's ``proj`` reads). The same maths, kernels and numbers as :func:`window_attention` on
    the views of ``qkv`` with ``tokens_first``; no copy around the op in either direction."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"window_attention: qkv must be a Tensor, got {type(qkv).__name__}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise TypeError(f"window_attention: heads must be a positive int, got {heads!r}")
    if qkv.dim() != 3 or qkv.shape[2] % (3 * heads):
        raise ValueError(
            f"window_attention: qkv must be [B*nW, N, 3 * heads * D] with heads = {heads}, "
            f"got {tuple(qkv.shape)}"
        )
    windows, n, c3 = qkv.shape
    if _wac.eager(qkv) and qkv.is_contiguous():  # the launchers check the rest
        scale = _checked_scale((("bias", bias),), mask, scale, c3 // (3 * heads))
        return _EagerPackedAttention.apply(qkv, bias, mask, scale, heads)
    q, k, v = _split_qkv(qkv, heads)
    return window_attention(q, k, v, bias, mask, scale, True).reshape(windows, n, -1)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    tokens_first: bool = False,
) -> torch.Tensor:
    """``softmax(scale * q @ k^T + bias + mask[b % nW]) @ v`` for Swin windows.

    q, k, v ``[B*nW, nH, N, D]`` of one dtype; ``bias`` ``[nH, N, N]`` and ``mask``
    ``[nW, N, N]`` of any float dtype (fp32 under autocast); ``scale`` defaults to
    ``D ** -0.5``. Differentiable in q, k, v and bias; the mask must not require grad.
    The result is ``[B*nW, nH, N, D]``, or ``[B*nW, N, nH, D]`` with ``tokens_first`` (then
    ``.reshape(B*nW, N, nH * D)`` is a view: no copy either way of the step).
    """
    named = (("q", q), ("k", k), ("v", v), ("bias", bias))
    scale = _checked_scale(named, mask, scale, q.shape[-1] if isinstance(q, torch.Tensor) else 0)
    if not isinstance(tokens_first, bool):
        raise TypeError(
            f"window_attention: tokens_first must be a bool, got {type(tokens_first).__name__}"
        )
    if _wac.eager(q):
        return _EagerAttention.apply(q, k, v, bias, mask, float(scale), tokens_first)
    return ATTENTION_OP(q, k, v, bias, mask, float(scale), tokens_first)
