"""Fused optimizer steps: ``aiak::fused_adam_``, ``aiak::fused_sgd_``, ``aiak::fused_lamb_``.

Each op updates a whole list of parameters (mixed fp32/fp16/bf16, one device) in place: one
CUDA launch for the update (plus one tiny launch that advances Adam's step counters), two for
LAMB after the global grad norm. State tensors have the parameter's dtype and layout, as in
torch's fused optimizers; arithmetic is fp32.

Shared conventions:

- ``state_steps``: one-element float32 tensors on the device; the op advances them by one.
- ``grad_scale`` / ``found_inf`` (GradScaler): grads are divided by ``grad_scale`` (and written
  back unscaled, as torch's fused optimizers do); when ``found_inf != 0`` nothing at all is
  written, step counters included. Both are read on the device: no host synchronisation.
- ``lr_tensor`` (capturable): when given, the learning rate is read from it on the device.
- ``copy_to`` (amp copy-back): empty, or one tensor per parameter that receives the updated
  parameter converted to its own dtype in the same pass; an empty tensor at position i means
  "no copy for parameter i".

Read top-down: checks, the PyTorch references (default kernels), the CUDA launchers, the ops.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from aiak.ops import _cuda, _mta
from aiak.ops._capability import (
    FLOAT_DTYPES,
    Capability,
    check_scalar_tensor,
    check_tensor_list,
    declare,
    is_dense,
    use_kernel,
)
from aiak.ops._registry import define

__all__: list[str] = []

ADAM = declare(Capability("fused_adam_"))
SGD = declare(Capability("fused_sgd_"))
LAMB = declare(Capability("fused_lamb_"))
_SOURCE = "fused_optim.cu"
_BLOCK = 512  # threads per chunk block; BLOCK in the source

# Flag bits, as in kernels/fused_optim.cu.
_ADAMW, _AMSGRAD, _MAXIMIZE, _BIAS_CORRECTION = 1, 2, 4, 8
_NESTEROV, _FIRST_STEP, _GRAD_AVERAGING, _NVLAMB = 16, 32, 64, 128

Tensors = Sequence[torch.Tensor]


# --------------------------------------------------------------------------------------------
# Arguments: one NamedTuple per op, in the op's schema order
# --------------------------------------------------------------------------------------------


class AdamArgs(NamedTuple):
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]  # empty unless amsgrad
    state_steps: list[torch.Tensor]
    copy_to: list[torch.Tensor]
    lr: float
    lr_tensor: torch.Tensor | None
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    amsgrad: bool
    maximize: bool
    bias_correction: bool
    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None


class SgdArgs(NamedTuple):
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    momentum_buffers: list[torch.Tensor]  # empty when momentum == 0
    copy_to: list[torch.Tensor]
    lr: float
    lr_tensor: torch.Tensor | None
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    is_first_step: bool  # momentum_buffer = d (torch SGD's first step) instead of the average
    scales: torch.Tensor | None  # [n] fp32 factors on the decayed grad (LARS trust ratios)
    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None


class LambArgs(NamedTuple):
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    updates: list[torch.Tensor]  # fp32 workspace, one per param, same layout
    state_steps: list[torch.Tensor]
    copy_to: list[torch.Tensor]
    grad_norm: torch.Tensor  # global L2 norm of the (still scaled) grads, fp32, one element
    lr: float
    lr_tensor: torch.Tensor | None
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    grad_averaging: bool
    adam_w_mode: bool
    use_nvlamb: bool
    max_grad_norm: float  # <= 0: no clipping
    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None


# --------------------------------------------------------------------------------------------
# Checks, shared by the reference and the kernel so both reject the same inputs
# --------------------------------------------------------------------------------------------


def _check_hyper(op: str, **values: float) -> None:
    for name, value in values.items():
        if name.startswith("beta"):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
        elif not value >= 0.0:  # also rejects NaN
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same memory order: strides agree wherever a dimension has size > 1."""
    if a.shape != b.shape:
        return False
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def _layouts(ts: Tensors) -> tuple:
    # map over unbound methods: the cheapest per-tensor calls from Python (this runs on every
    # step, for hundreds of tensors).
    return tuple(map(_shape, ts)), tuple(map(torch.Tensor.stride, ts)), tuple(map(_dtype, ts))


def _check_lists(
    op: str,
    params: Tensors,
    same: dict[str, Tensors],
    copy_to: Tensors,
    state_steps: Tensors | None,
    scalars: dict[str, torch.Tensor | None],
) -> torch.device | None:
    """``same``: lists aligned with ``params`` (same shape, strides and dtype per position;
    ``updates`` are fp32). The usual all-fine case costs a few C-level maps per list."""
    device = check_tensor_list(op, "params", params, FLOAT_DTYPES)
    n = len(params)
    shapes, strides, dtypes = _layouts(params)
    for name, ts in same.items():
        d = check_tensor_list(op, name, ts, FLOAT_DTYPES)
        if len(ts) != n:
            raise ValueError(f"{op}: {name} has {len(ts)} tensors but params has {n}")
        if n and d != device:
            raise ValueError(f"{op}: {name} is on {d} but params are on {device}")
        want = (torch.float32,) * n if name == "updates" else dtypes
        if _layouts(ts) != (shapes, strides, want):
            _explain_mismatch(op, name, params, ts)
    if copy_to:
        d = check_tensor_list(op, "copy_to", copy_to, FLOAT_DTYPES)
        if len(copy_to) != n:
            raise ValueError(f"{op}: copy_to has {len(copy_to)} tensors but params has {n}")
        if d != device:
            raise ValueError(f"{op}: copy_to is on {d} but params are on {device}")
        for i, (p, t) in enumerate(zip(params, copy_to)):
            if t.numel() and not _same_layout(p, t):
                raise ValueError(
                    f"{op}: copy_to[{i}] must be empty or match params[{i}] in shape and strides"
                )
    if state_steps is not None:
        if len(state_steps) != n:
            raise ValueError(f"{op}: state_steps has {len(state_steps)} tensors but params has {n}")
        d = check_tensor_list(op, "state_steps", state_steps, (torch.float32,))
        if n and (d != device or set(map(torch.Tensor.numel, state_steps)) != {1}):
            for i, s in enumerate(state_steps):
                check_scalar_tensor(op, f"state_steps[{i}]", s, device, torch.float32)
    for name, t in scalars.items():
        if t is not None:
            check_scalar_tensor(op, name, t, device, torch.float32)
    return device


def _explain_mismatch(op: str, name: str, params: Tensors, ts: Tensors) -> None:
    """Raise naming the first tensor of ``ts`` unlike its param (strides may differ where a
    dimension has size 1: the memory order is the same)."""
    for i, (p, t) in enumerate(zip(params, ts)):
        if not _same_layout(p, t):
            raise ValueError(
                f"{op}: {name}[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) must match "
                f"params[{i}] (shape {tuple(p.shape)}, strides {p.stride()})"
            )
        want = torch.float32 if name == "updates" else p.dtype
        if t.dtype != want:
            raise TypeError(f"{op}: {name}[{i}] is {t.dtype}, must be {want}")


def _check_scalars(op: str, device: torch.device, **scalars: torch.Tensor | None) -> None:
    for name, t in scalars.items():
        if t is not None:
            check_scalar_tensor(op, name, t, device, torch.float32)


def _check_adam_scalars(a: AdamArgs) -> None:
    op = "fused_adam_"
    _check_hyper(op, lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
    _check_scalars(
        op,
        a.params[0].device,
        lr_tensor=a.lr_tensor,
        grad_scale=a.grad_scale,
        found_inf=a.found_inf,
    )


def _check_sgd_scalars(a: SgdArgs) -> None:
    op = "fused_sgd_"
    _check_hyper(
        op, lr=a.lr, momentum=a.momentum, dampening=a.dampening, weight_decay=a.weight_decay
    )
    _check_scalars(
        op,
        a.params[0].device,
        lr_tensor=a.lr_tensor,
        grad_scale=a.grad_scale,
        found_inf=a.found_inf,
    )
    if a.scales is not None:
        _check_sgd(a)  # rare (LARS): the full check covers the scales' shape


def _check_lamb_scalars(a: LambArgs) -> None:
    op = "fused_lamb_"
    _check_hyper(op, lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
    _check_scalars(
        op,
        a.params[0].device,
        grad_norm=a.grad_norm,
        lr_tensor=a.lr_tensor,
        grad_scale=a.grad_scale,
        found_inf=a.found_inf,
    )


def _check_adam(a: AdamArgs) -> torch.device | None:
    op = "fused_adam_"
    _check_hyper(op, lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
    same = {"grads": a.grads, "exp_avgs": a.exp_avgs, "exp_avg_sqs": a.exp_avg_sqs}
    if a.amsgrad:
        same["max_exp_avg_sqs"] = a.max_exp_avg_sqs
    scalars = {"lr_tensor": a.lr_tensor, "grad_scale": a.grad_scale, "found_inf": a.found_inf}
    return _check_lists(op, a.params, same, a.copy_to, a.state_steps, scalars)


def _check_sgd(a: SgdArgs) -> torch.device | None:
    op = "fused_sgd_"
    _check_hyper(
        op, lr=a.lr, momentum=a.momentum, dampening=a.dampening, weight_decay=a.weight_decay
    )
    same = {"grads": a.grads}
    if a.momentum != 0:
        same["momentum_buffers"] = a.momentum_buffers
    elif a.momentum_buffers:
        raise ValueError(f"{op}: momentum_buffers must be empty when momentum is 0")
    scalars = {"lr_tensor": a.lr_tensor, "grad_scale": a.grad_scale, "found_inf": a.found_inf}
    device = _check_lists(op, a.params, same, a.copy_to, None, scalars)
    if a.scales is not None:
        if not isinstance(a.scales, torch.Tensor) or a.scales.dtype != torch.float32:
            raise TypeError(f"{op}: scales must be a float32 tensor")
        if a.scales.shape != (len(a.params),) or (a.params and a.scales.device != device):
            raise ValueError(f"{op}: scales must have shape ({len(a.params)},) on {device}")
    return device


def _check_lamb(a: LambArgs) -> torch.device | None:
    op = "fused_lamb_"
    _check_hyper(op, lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
    same = {
        "grads": a.grads,
        "exp_avgs": a.exp_avgs,
        "exp_avg_sqs": a.exp_avg_sqs,
        "updates": a.updates,
    }
    scalars = {
        "grad_norm": a.grad_norm,
        "lr_tensor": a.lr_tensor,
        "grad_scale": a.grad_scale,
        "found_inf": a.found_inf,
    }
    return _check_lists(op, a.params, same, a.copy_to, a.state_steps, scalars)


# --------------------------------------------------------------------------------------------
# References (default kernels): the kernels' math, one tensor at a time, in fp32
# --------------------------------------------------------------------------------------------


def _keep(found_inf: torch.Tensor | None) -> torch.Tensor | None:
    """A bool scalar: True when the step is applied. Used with torch.where, never on the host."""
    return None if found_inf is None else found_inf.reshape(()) == 0


def _commit(dst: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> None:
    dst.copy_(new if keep is None else torch.where(keep, new, dst))


def _commit_step(step: torch.Tensor, keep: torch.Tensor | None) -> None:
    step.add_(1.0 if keep is None else keep.to(step.dtype))


def _scale_of(grad_scale: torch.Tensor | None) -> torch.Tensor | float:
    return 1.0 if grad_scale is None else grad_scale.reshape(()).float()


def _lr_of(lr: float, lr_tensor: torch.Tensor | None) -> torch.Tensor | float:
    return lr if lr_tensor is None else lr_tensor.reshape(()).float()


def _bias_corrections(
    step: torch.Tensor, beta1: float, beta2: float, enabled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """1 - beta^t for the step this update makes (stored step + 1), in fp64 like the kernel."""
    t = step.reshape(()).double() + 1
    one = torch.ones((), dtype=torch.float64, device=step.device)
    return (1 - beta1**t, 1 - beta2**t) if enabled else (one, one)


def _adam_reference(a: AdamArgs) -> None:
    _check_adam(a)
    keep, scale, rate = _keep(a.found_inf), _scale_of(a.grad_scale), _lr_of(a.lr, a.lr_tensor)
    wd = a.weight_decay
    for i, p in enumerate(a.params):
        bc1, bc2 = _bias_corrections(a.state_steps[i], a.beta1, a.beta2, a.bias_correction)
        step_size = (rate / bc1).float()
        bc2_sqrt = bc2.sqrt().float()
        x = p.float()
        g = a.grads[i].float() / scale
        gg = -g if a.maximize else g
        if wd != 0:
            if a.adam_w_mode:
                x = x - rate * wd * x
            else:
                gg = gg + wd * x
        m = a.beta1 * a.exp_avgs[i].float() + (1 - a.beta1) * gg
        v = a.beta2 * a.exp_avg_sqs[i].float() + (1 - a.beta2) * gg * gg
        v_hat = v
        if a.amsgrad:
            v_hat = torch.maximum(a.max_exp_avg_sqs[i].float(), v)
            _commit(a.max_exp_avg_sqs[i], v_hat, keep)
        x = x - step_size * m / (v_hat.sqrt() / bc2_sqrt + a.eps)
        _commit(p, x, keep)
        if a.grad_scale is not None:
            _commit(a.grads[i], g, keep)
        _commit(a.exp_avgs[i], m, keep)
        _commit(a.exp_avg_sqs[i], v, keep)
        if a.copy_to and a.copy_to[i].numel():
            _commit(a.copy_to[i], x, keep)
        _commit_step(a.state_steps[i], keep)


def _sgd_reference(a: SgdArgs) -> None:
    _check_sgd(a)
    keep, scale, rate = _keep(a.found_inf), _scale_of(a.grad_scale), _lr_of(a.lr, a.lr_tensor)
    for i, p in enumerate(a.params):
        x = p.float()
        g = a.grads[i].float() / scale
        d = -g if a.maximize else g
        if a.weight_decay != 0:
            d = d + a.weight_decay * x
        if a.scales is not None:
            d = d * a.scales[i]
        if a.momentum != 0:
            if a.is_first_step:
                buf = d
            else:
                buf = a.momentum * a.momentum_buffers[i].float() + (1 - a.dampening) * d
            _commit(a.momentum_buffers[i], buf, keep)
            d = d + a.momentum * buf if a.nesterov else buf
        x = x - rate * d
        _commit(p, x, keep)
        if a.grad_scale is not None:
            _commit(a.grads[i], g, keep)
        if a.copy_to and a.copy_to[i].numel():
            _commit(a.copy_to[i], x, keep)


def _lamb_reference(a: LambArgs) -> None:
    _check_lamb(a)
    keep, scale, rate = _keep(a.found_inf), _scale_of(a.grad_scale), _lr_of(a.lr, a.lr_tensor)
    wd = a.weight_decay
    norm = a.grad_norm.reshape(()).float() / scale
    clip = torch.ones_like(norm)
    if a.max_grad_norm > 0:
        clip = torch.where(norm > a.max_grad_norm, norm / a.max_grad_norm, clip)
    beta3 = 1 - a.beta1 if a.grad_averaging else 1.0
    for i, p in enumerate(a.params):
        bc1, bc2 = _bias_corrections(a.state_steps[i], a.beta1, a.beta2, a.bias_correction)
        x = p.float()
        g = a.grads[i].float() / scale / clip
        if not a.adam_w_mode:
            g = g + wd * x
        m = a.beta1 * a.exp_avgs[i].float() + beta3 * g
        v = a.beta2 * a.exp_avg_sqs[i].float() + (1 - a.beta2) * g * g
        u = (m / bc1.float()) / ((v / bc2.float()).sqrt() + a.eps)
        if a.adam_w_mode:
            u = u + wd * x
        pn, un = torch.linalg.vector_norm(x), torch.linalg.vector_norm(u)
        ratio = torch.ones_like(pn) * rate
        if a.use_nvlamb or wd != 0:
            ratio = torch.where((pn > 0) & (un > 0), rate * (pn / un), ratio)
        x = x - ratio * u
        _commit(p, x, keep)
        _commit(a.exp_avgs[i], m, keep)
        _commit(a.exp_avg_sqs[i], v, keep)
        _commit(a.updates[i], u, keep)
        if a.copy_to and a.copy_to[i].numel():
            _commit(a.copy_to[i], x, keep)
        _commit_step(a.state_steps[i], keep)


# --------------------------------------------------------------------------------------------
# CUDA launchers
# --------------------------------------------------------------------------------------------


def _kargs(*values: object) -> tuple:
    """Kernel arguments: a tensor (or None) -> its pointer, an int -> int32, a float -> float32."""
    import numpy as np  # here: `import aiak.ops` stays free of numpy

    out = []
    for v in values:
        if v is None or isinstance(v, torch.Tensor):
            out.append(_cuda.ptr(v))
        elif isinstance(v, int):
            out.append(_cuda.i32(v))
        else:
            out.append(np.float32(v))
    return tuple(out)


_nulls: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def _copy_list(copy_to: Tensors, n: int, device: torch.device) -> list[torch.Tensor]:
    """``copy_to``, or n empty tensors (null pointers: "no copy") when it is empty."""
    if copy_to:
        return list(copy_to)
    key = (device, n)
    found = _nulls.get(key)
    if found is None:
        found = [torch.empty(0, device=device)] * n
        _nulls[key] = found
    return found


_validated: dict[int, _mta.Table] = {}


def _checked_table(
    lists: list[Tensors],
    device: torch.device,
    cap: Capability,
    params: Tensors,
    copy_to: Tensors,
    check: Callable[[], object],
    check_cheap: Callable[[], object],
) -> _mta.Table | None:
    """The device table for ``lists``, or None when the reference must run instead.

    The full input check walks every tensor of every list (~1 ms for 161 tensors x 6 lists
    on the host, more than the kernel's 0.27 ms); it runs once per tensor set. A table is
    keyed by the lists' addresses, sizes and dtypes, so a set seen and validated before is
    the same set: later steps only check the scalars and hyper-parameters.
    """
    check_cheap()
    try:
        dtypes = set(map(_dtype, params)) | set(map(_dtype, copy_to))
        usable = use_kernel(cap, device, dtypes)
    except AttributeError:  # not tensors: the full check names the culprit
        check()
        raise
    if not usable:
        check()
        return None
    try:
        tab = _mta.table(lists, device)
    except (KeyError, AttributeError, TypeError):
        check()  # raises with the argument's name
        raise
    if _validated.get(id(tab)) is not tab:
        check()
        if not (all(map(torch.Tensor.is_contiguous, params)) or all(map(is_dense, params))):
            return None  # the kernel walks memory linearly: a strided view takes the reference
        if len(_validated) >= 4 * _mta.CACHE_SIZE:
            _validated.clear()
        _validated[id(tab)] = tab
    return tab


def _flags(**bits: tuple[int, bool]) -> int:
    return sum(bit for bit, on in bits.values() if on)


def _adam_cuda(*args: object) -> None:
    a = AdamArgs(*args)
    if not a.params:
        _check_adam(a)
        return
    device = a.params[0].device
    n = len(a.params)
    optional = [a.max_exp_avg_sqs] if a.amsgrad else []
    # List order as in the kernel: p, g, m, v, step, copy_to, [max_v].
    table = [
        a.params,
        a.grads,
        a.exp_avgs,
        a.exp_avg_sqs,
        a.state_steps,
        _copy_list(a.copy_to, n, device),
        *optional,
    ]
    tab = _checked_table(
        table,
        device,
        ADAM,
        a.params,
        a.copy_to,
        lambda: _check_adam(a),
        lambda: _check_adam_scalars(a),
    )
    if tab is None:
        _adam_reference(a)
        return
    flags = _flags(
        adamw=(_ADAMW, a.adam_w_mode),
        amsgrad=(_AMSGRAD, a.amsgrad),
        maximize=(_MAXIMIZE, a.maximize),
        bias=(_BIAS_CORRECTION, a.bias_correction),
    )
    with _cuda.on_device(device):
        if tab.num_chunks:
            fn = _cuda.get_function(_SOURCE, "fused_adam")
            hyper = (a.lr, a.beta1, a.beta2, a.eps, a.weight_decay)
            args = _kargs(tab.data, n, len(table), a.lr_tensor, *map(float, hyper), flags)
            _cuda.launch(fn, tab.num_chunks, _BLOCK, args + _kargs(a.grad_scale, a.found_inf))
        # The steps advance after the update has read them (stream order); list 4 holds them.
        fn = _cuda.get_function(_SOURCE, "bump_steps")
        _cuda.launch(fn, (n + 255) // 256, 256, _kargs(tab.data, n, 4, a.found_inf))


def _sgd_cuda(*args: object) -> None:
    a = SgdArgs(*args)
    if not a.params:
        _check_sgd(a)
        return
    device = a.params[0].device
    n = len(a.params)
    # List order as in the kernel: p, g, copy_to, [momentum_buffer].
    optional = [a.momentum_buffers] if a.momentum != 0 else []
    table = [a.params, a.grads, _copy_list(a.copy_to, n, device), *optional]
    tab = _checked_table(
        table,
        device,
        SGD,
        a.params,
        a.copy_to,
        lambda: _check_sgd(a),
        lambda: _check_sgd_scalars(a),
    )
    if tab is None:
        _sgd_reference(a)
        return
    flags = _flags(
        nesterov=(_NESTEROV, a.nesterov),
        maximize=(_MAXIMIZE, a.maximize),
        first=(_FIRST_STEP, a.is_first_step),
    )
    with _cuda.on_device(device):
        if tab.num_chunks:
            fn = _cuda.get_function(_SOURCE, "fused_sgd")
            hyper = (a.lr, a.momentum, a.dampening, a.weight_decay)
            args = _kargs(tab.data, n, len(table), a.lr_tensor, *map(float, hyper), flags)
            _cuda.launch(
                fn, tab.num_chunks, _BLOCK, args + _kargs(a.scales, a.grad_scale, a.found_inf)
            )


def _lamb_cuda(*args: object) -> None:
    a = LambArgs(*args)
    if not a.params:
        _check_lamb(a)
        return
    device = a.params[0].device
    n = len(a.params)
    # List order as in the kernels: p, g, m, v, update, step, copy_to.
    table = [
        a.params,
        a.grads,
        a.exp_avgs,
        a.exp_avg_sqs,
        a.updates,
        a.state_steps,
        _copy_list(a.copy_to, n, device),
    ]
    tab = _checked_table(
        table,
        device,
        LAMB,
        a.params,
        a.copy_to,
        lambda: _check_lamb(a),
        lambda: _check_lamb_scalars(a),
    )
    if tab is None:
        _lamb_reference(a)
        return
    flags = _flags(
        adamw=(_ADAMW, a.adam_w_mode),
        bias=(_BIAS_CORRECTION, a.bias_correction),
        averaging=(_GRAD_AVERAGING, a.grad_averaging),
        nvlamb=(_NVLAMB, a.use_nvlamb),
    )
    with _cuda.on_device(device):
        c = tab.num_chunks
        # Per-chunk sums of p^2 and u^2 from stage 1, reduced per tensor by stage 2.
        partials = torch.empty(2 * max(c, 1), dtype=torch.float32, device=device)
        if c:
            fn = _cuda.get_function(_SOURCE, "fused_lamb_stage1")
            hyper = (a.beta1, a.beta2, a.eps, a.weight_decay, a.max_grad_norm)
            args = _kargs(tab.data, n, len(table), partials, *map(float, hyper), flags)
            args += _kargs(a.grad_norm, a.grad_scale, a.found_inf)
            _cuda.launch(fn, c, _BLOCK, args)
        # Blocks past the c chunks advance the n step counters (ceil(n / BLOCK) of them).
        fn = _cuda.get_function(_SOURCE, "fused_lamb_stage2")
        args = _kargs(tab.data, n, len(table), c, partials, a.lr_tensor, float(a.lr))
        args += _kargs(float(a.weight_decay), flags, a.found_inf)
        _cuda.launch(fn, c + (n + _BLOCK - 1) // _BLOCK, _BLOCK, args)


# --------------------------------------------------------------------------------------------
# The ops. Their signatures are the NamedTuples above, field for field.
# --------------------------------------------------------------------------------------------


# Schemas, field for field as the NamedTuples above; (a!)...: the lists the kernels write.
_ADAM_SCHEMA = (
    "fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
    "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, "
    "Tensor(g!)[] copy_to, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
    "float weight_decay, bool adam_w_mode, bool amsgrad, bool maximize, bool bias_correction, "
    "Tensor? grad_scale, Tensor? found_inf) -> ()"
)
_SGD_SCHEMA = (
    "fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
    "Tensor(d!)[] copy_to, float lr, Tensor? lr_tensor, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool maximize, bool is_first_step, Tensor? scales, "
    "Tensor? grad_scale, Tensor? found_inf) -> ()"
)
_LAMB_SCHEMA = (
    "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] updates, Tensor(e!)[] state_steps, "
    "Tensor(f!)[] copy_to, Tensor grad_norm, float lr, Tensor? lr_tensor, float beta1, "
    "float beta2, float eps, float weight_decay, bool bias_correction, bool grad_averaging, "
    "bool adam_w_mode, bool use_nvlamb, float max_grad_norm, Tensor? grad_scale, "
    "Tensor? found_inf) -> ()"
)


def _positional(fn: Callable[[Any], object], fields: type) -> Callable[..., None]:
    """A kernel taking the op's arguments positionally, from one taking the NamedTuple."""

    def kernel(*args: object) -> None:
        fn(fields(*args))

    return kernel


def _fake(check: Callable[[Any], object], fields: type) -> Callable[..., None]:
    # The ops return nothing: the fake implementation only validates (shapes are unchanged).
    def fake(*args: object) -> None:
        check(fields(*args))

    return fake


# Calling one of these is the eager fast path (see ops/_registry.py: the kernel straight from
# Python when the dispatcher is not needed); ``.overload`` is torch.ops.aiak.fused_*.default.
fused_adam_ = define(
    _ADAM_SCHEMA,
    _positional(_adam_reference, AdamArgs),
    cuda=_adam_cuda,
    fake=_fake(_check_adam, AdamArgs),
)
fused_sgd_ = define(
    _SGD_SCHEMA,
    _positional(_sgd_reference, SgdArgs),
    cuda=_sgd_cuda,
    fake=_fake(_check_sgd, SgdArgs),
)
fused_lamb_ = define(
    _LAMB_SCHEMA,
    _positional(_lamb_reference, LambArgs),
    cuda=_lamb_cuda,
    fake=_fake(_check_lamb, LambArgs),
)
__all__ += ["fused_adam_", "fused_lamb_", "fused_sgd_"]
