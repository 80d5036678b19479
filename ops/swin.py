"""``convert(model)``: a timm SwinTransformer running on aiak's window-attention ops.

What changes, module by module (the model's parameters, buffers and state_dict keys stay):

- every timm ``WindowAttention`` becomes a :class:`FusedWindowAttention` that shares its
  ``qkv``/``proj`` layers, bias table and index, and computes the attention core with
  ``aiak::window_attention`` on qkv's output as it is (``window_attention_qkv``; bias gathered
  from the table as timm does, so the table's gradient flows through torch's gather);
- every ``SwinTransformerBlock`` whose windows tile the feature map (no padding, one square
  window, equal shifts, a fixed mask buffer) gets an ``_attn`` that does the roll + partition
  and its inverse with ``aiak::roll_window_partition`` / ``aiak::window_merge_roll`` in eager
  (under ``torch.compile``, timm's roll and partition, which inductor fuses with the ops
  around them); any other block keeps timm's own ``_attn``.

Modules are recognised by their attributes (timm is not imported here). Attention dropout > 0
cannot run fused: such modules stay as they are, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from aiak.ops._bound import Bound
from aiak.ops.window_attention import (
    roll_window_partition,
    window_attention_qkv,
    window_merge_roll,
)

__all__ = ["FusedWindowAttention", "convert", "find_window_attention"]

_ATTENTION_ATTRS = ("relative_position_bias_table", "relative_position_index", "qkv", "proj")


class FusedWindowAttention(nn.Module):
    """timm's WindowAttention with the attention core in ``aiak::window_attention``.

    Built from a timm module, sharing its submodules and tensors; ``forward(x, mask=None)``
    keeps timm's signature: x ``[B*nW, N, C]``, mask ``[nW, N, N]``.
    """

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.num_heads = int(source.num_heads)
        self.scale = float(source.scale)
        self.window_size = tuple(source.window_size)
        self.window_area = int(self.window_size[0] * self.window_size[1])
        self.qkv = source.qkv
        self.proj = source.proj
        self.proj_drop = getattr(source, "proj_drop", nn.Identity())
        self.relative_position_bias_table = source.relative_position_bias_table
        persistent = "relative_position_index" not in source._non_persistent_buffers_set
        self.register_buffer(
            "relative_position_index", source.relative_position_index, persistent=persistent
        )

    def relative_position_bias(self) -> torch.Tensor:
        """``[nH, N, N]``: the table gathered by the index, the values timm computes.

        One ``index_select`` along the transposed table writes ``[nH, N*N]`` in the kernel's
        layout directly (timm's ``table[index]`` then ``.permute().contiguous()`` is two
        kernels forward and a sort-based ``index_put_`` backward)."""
        n = self.window_area
        table = self.relative_position_bias_table
        bias = table.t().index_select(1, self.relative_position_index.view(-1))
        return bias.view(-1, n, n)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # q, k, v read in place from qkv's output, the result written in proj's input layout,
        # and (eager) the gradients of q, k, v written into one gradient of qkv's output
        out = window_attention_qkv(
            self.qkv(x), self.num_heads, self.relative_position_bias(), mask, self.scale
        )
        return self.proj_drop(self.proj(out))


def _is_window_attention(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("WindowAttention")
        and not isinstance(module, FusedWindowAttention)
        and all(hasattr(module, a) for a in _ATTENTION_ATTRS)
        and hasattr(module, "num_heads")
        and hasattr(module, "scale")
    )


def _attention_dropout(module: nn.Module) -> float:
    drop = getattr(module, "attn_drop", None)
    return float(drop.p) if isinstance(drop, nn.Dropout) else 0.0


def find_window_attention(*roots: nn.Module) -> tuple[list[nn.Module], int, int]:
    """What :func:`convert` finds under ``roots``: (the window attention modules it fuses, the
    number already fused, the number it leaves as they are for their attention dropout)."""
    todo: list[nn.Module] = []
    fused = dropout = 0
    seen: set[int] = set()
    for root in roots:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            if isinstance(m, FusedWindowAttention):
                fused += 1
            elif _is_window_attention(m):
                if _attention_dropout(m) > 0:
                    dropout += 1
                else:
                    todo.append(m)
    return todo, fused, dropout


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _fused_block_attn(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``SwinTransformerBlock._attn`` (x ``[B, H, W, C]``) with one gather each way.

    Under ``torch.compile`` the block keeps timm's roll + partition (its attention is still
    fused): inductor fuses them into the neighbouring LayerNorm and residual kernels, which an
    opaque gather op prevents. Compiled Swin-T b64 fp16 training step, kernel time per step on
    an H200: 12.8 ms with timm's roll + partition, 13.5 ms with the gather ops, 16.2 ms for
    compile alone."""
    _, h, w, _c = x.shape
    ws, _ = _pair(self.window_size)
    shift, _ = _pair(self.shift_size)
    if h % ws or w % ws or torch.compiler.is_compiling():  # timm pads such maps itself
        return self._aiak_timm_attn(x)
    windows = roll_window_partition(x, ws, shift)
    windows = self.attn(windows, mask=self.attn_mask)
    return window_merge_roll(windows, h, w, shift)


def _convertible_block(block: nn.Module) -> bool:
    if not (
        hasattr(block, "_attn")
        and isinstance(getattr(block, "attn", None), FusedWindowAttention)
        and hasattr(block, "window_size")
        and hasattr(block, "shift_size")
        and hasattr(block, "attn_mask")
    ):
        return False
    if getattr(block, "dynamic_mask", False) or getattr(block, "always_partition", False):
        return False
    wh, ww = _pair(block.window_size)
    sh, sw = _pair(block.shift_size)
    return wh == ww and sh == sw


def convert(model: nn.Module) -> nn.Module:
    """Return ``model`` (changed in place) with its Swin window attention on aiak's ops.

    Parameters, buffers and ``state_dict`` keys are unchanged (the same objects), so
    checkpoints load either way and an optimizer built before the call still holds them.
    Convert before wrapping the model in DDP or ``torch.compile``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    seen = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_window_attention(child):
                continue
            seen += 1
            p = _attention_dropout(child)
            if p > 0:
                warnings.warn(
                    f"convert: {type(child).__name__} with attention dropout {p} stays "
                    "unfused (the kernel has no dropout)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            setattr(parent, name, FusedWindowAttention(child))
    if _is_window_attention(model):
        raise TypeError("convert: pass the model that contains the WindowAttention, not it")
    for block in model.modules():
        if _convertible_block(block) and not hasattr(block, "_aiak_timm_attn"):
            block._aiak_timm_attn = Bound(type(block)._attn, block)
            block._attn = Bound(_fused_block_attn, block)
    if seen == 0 and not any(isinstance(m, FusedWindowAttention) for m in model.modules()):
        warnings.warn("convert: no Swin WindowAttention module found", RuntimeWarning, stacklevel=2)
    return model
