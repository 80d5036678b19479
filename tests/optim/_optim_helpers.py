"""Shared by the optim tests: parameter sets, a lock-step runner, the float64 references.

The LAMB/LARS references are the conformance suite's (plain per-tensor float64 code written
from apex FusedLAMB's semantics and the LARS docstring), independent of aiak.ops' code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from _numerics import rel_err

from aiak.conformance.cases.optim import lamb_reference, lars_reference

__all__ = ["clones", "lamb_reference", "lars_reference", "lockstep", "make_params", "rel_l2"]

SHAPES = [(3, 5), (7,), (1,), (33, 17), (0,), (2, 1, 4)]


def make_params(
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    device: str = "cpu",
    gen: torch.Generator | None = None,
    unaligned: bool = False,
) -> list[torch.Tensor]:
    out = []
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        off = 1 if unaligned else 0  # an odd element offset: no 8/16-byte vector access
        base = torch.randn(n + off, generator=gen).to(device=device, dtype=dtype)
        out.append(base[off:].view(s))
    return out


def lockstep(
    opts: Sequence[tuple[torch.optim.Optimizer, list[torch.Tensor]]],
    steps: int,
    grad_scale: float = 1.0,
    gen: torch.Generator | None = None,
) -> None:
    """Feed the same random grads to every (optimizer, params) and step them ``steps`` times."""
    first = opts[0][1]
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen) * grad_scale for p in first]
        for opt, params in opts:
            for p, g in zip(params, grads):
                p.grad = g.to(device=p.device, dtype=p.dtype)
            opt.step()


def clones(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def rel_l2(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """The relative L2 error of two tensor lists taken as one vector each."""
    return rel_err(
        torch.cat([o.detach().reshape(-1) for o in out]),
        torch.cat([r.detach().reshape(-1) for r in ref]),
    )


K = 10  # steps per parity run
HALF = [torch.float16, torch.bfloat16]


def groups(params: list[torch.Tensor], **second: float) -> list[dict]:
    """Two param groups, the second with its own hyper-parameters."""
    return [{"params": params[:3]}, {"params": params[3:], **second}]


def exact(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")


def within_ulp(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """At most one rounding step apart: same fp32 math, stores rounded once each."""
    for x, y in zip(a, b):
        eps = torch.finfo(x.dtype).eps
        torch.testing.assert_close(x, y, rtol=eps, atol=eps * 1e-3)
