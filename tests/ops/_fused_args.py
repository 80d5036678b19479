"""Valid arguments of the fused optimizer ops, as their argument records (one per op, fields as
in the op's schema), for the per-op tests."""

from __future__ import annotations

import torch
from _numerics import rel_err

import aiak.ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(5,), (3, 4), (70_000,), (0,), (2, 1, 3)]


def _params(device: str, dtypes, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=g).to(device, dtypes[i % len(dtypes)])
        for i, s in enumerate(SHAPES)
    ]


def _like(ps, seed: int, positive: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in ps]
    return [t.abs() for t in out] if positive else out


def _steps(ps) -> list[torch.Tensor]:
    return [torch.full((), 3.0, device=p.device) for p in ps]


def adam(device: str = "cpu", dtypes=DTYPES, seed: int = 0, **change):
    ps = _params(device, dtypes, seed)
    kw = dict(
        params=ps, grads=_like(ps, seed + 1), exp_avgs=_like(ps, seed + 2),
        exp_avg_sqs=_like(ps, seed + 3, True), max_exp_avg_sqs=[], state_steps=_steps(ps),
        copy_to=[], lr=1e-2, lr_tensor=None, beta1=0.9, beta2=0.99, eps=1e-8,
        weight_decay=0.01, adam_w_mode=True, amsgrad=False, maximize=False,
        bias_correction=True, grad_scale=None, found_inf=None,
    )  # fmt: skip
    kw.update(change)
    return aiak.ops.fused_adam_.Args(**kw)


def sgd(device: str = "cpu", dtypes=DTYPES, seed: int = 0, **change):
    ps = _params(device, dtypes, seed)
    kw = dict(
        params=ps, grads=_like(ps, seed + 1), momentum_buffers=_like(ps, seed + 2), copy_to=[],
        lr=0.1, lr_tensor=None, momentum=0.9, dampening=0.1, weight_decay=0.01,
        nesterov=False, maximize=False, is_first_step=False, scales=None, grad_scale=None,
        found_inf=None,
    )  # fmt: skip
    kw.update(change)
    return aiak.ops.fused_sgd_.Args(**kw)


def lamb(device: str = "cpu", dtypes=DTYPES, seed: int = 0, **change):
    ps = _params(device, dtypes, seed)
    kw = dict(
        params=ps, grads=_like(ps, seed + 1), exp_avgs=_like(ps, seed + 2),
        exp_avg_sqs=_like(ps, seed + 3, True),
        updates=[torch.zeros_like(p, dtype=torch.float32) for p in ps], state_steps=_steps(ps),
        copy_to=[], grad_norms=[torch.tensor(3.0, device=device)], lr=1e-2, lr_tensor=None,
        beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, bias_correction=True,
        grad_averaging=True, adam_w_mode=True, use_nvlamb=False, max_grad_norm=1.0,
        grad_scale=None, found_inf=None,
    )  # fmt: skip
    kw.update(change)
    return aiak.ops.fused_lamb_.Args(**kw)


def clone(a):
    """A deep copy of an argument record (tensors and lists of tensors cloned)."""
    out = []
    for v in a:
        if isinstance(v, torch.Tensor):
            v = v.clone()
        elif isinstance(v, list):
            v = [t.clone() for t in v]
        out.append(v)
    return type(a)(*out)


def assert_same(a, b, tol: dict[torch.dtype, float]) -> None:
    """Every tensor of two records close, by the relative L2 error of its dtype."""
    for name, x, y in zip(a._fields, a, b):
        xs = x if isinstance(x, list) else [x] if isinstance(x, torch.Tensor) else []
        ys = y if isinstance(y, list) else [y] if isinstance(y, torch.Tensor) else []
        params = getattr(a, "params", None)
        for i, (u, v) in enumerate(zip(xs, ys)):
            bound = tol.get(u.dtype, 1e-6)
            if isinstance(x, list) and params is not None and i < len(params):
                # fp32 per-param values (LAMB's updates) computed from a half param carry the
                # param's rounding: the kernel and the reference round it in different places
                bound = max(bound, tol.get(params[i].dtype, 1e-6))
            err = rel_err(u.cpu(), v.cpu())
            assert err <= bound, f"{name}[{i}]: rel L2 error {err:.2e} > {bound:g}"
