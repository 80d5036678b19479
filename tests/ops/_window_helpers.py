"""Shared by the window-attention tests: both paths' outputs and gradients, opcheck, and a
counter of the aten ops that copy data."""

from __future__ import annotations

import torch
from _window_literal import inputs
from torch.utils._python_dispatch import TorchDispatchMode


def both_paths(fn, leaves, grad):
    """(outputs, grads) of ``fn`` on fresh copies of ``leaves``, backward with ``grad``."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves]


def opcheck_samples(device, dtype):
    q, k, v, bias, mask = inputs(4, 2, 7, 32, 2, dtype=dtype, device=device)
    strided = torch.randn(4, 7, 3, 2, 32, dtype=dtype, device=device).permute(2, 0, 3, 1, 4)
    qs, ks, vs = strided.unbind(0)
    return [
        (q, k, v, bias, mask, 0.3, False),
        (q, k, v, bias, None, 0.3, True),
        (qs, ks, vs, bias, mask, 0.2, True),
    ]


def opcheck_all(device, dtype):
    for q, k, v, bias, mask, scale, tokens_first in opcheck_samples(device, dtype):
        grads = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        torch.library.opcheck(
            torch.ops.aiak.window_attention.default, (*grads, mask, scale, tokens_first)
        )
        dout = torch.randn_like(q)
        if tokens_first:  # the backward's grad as autograd hands it over: a transposed view
            dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
        torch.library.opcheck(
            torch.ops.aiak.window_attention_backward.default, (dout, q, k, v, bias, mask, scale)
        )
    q, k, v, bias, mask, scale, _ = opcheck_samples(device, dtype)[0]
    torch.library.opcheck(torch.ops.aiak.window_attention.default, (q, k, v, bias, mask, scale))
    x = torch.randn(2, 14, 7, 6, dtype=dtype, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.aiak.roll_window_partition.default, (x, 7, 3))
    w = torch.randn(4, 49, 6, dtype=dtype, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.aiak.window_merge_roll.default, (w, 14, 7, 3))


class Copies(TorchDispatchMode):
    """Counts the aten ops that copy a tensor's data."""

    COPIES = ("clone", "copy_", "_to_copy", "contiguous", "stack", "cat")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in self.COPIES
        return func(*args, **(kwargs or {}))
