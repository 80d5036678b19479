"""Conformance of ``aiak.ops.batch_norm_act``: training-mode batch norm, + residual, ReLU.

Forward (y), the gradients of input, weight, bias and residual, and the running mean and
variance after one call (momentum 0.1, unbiased variance), against ``F.batch_norm`` + add +
ReLU in float64 with autograd, for fp32, fp16 and bf16 activations (fp32 weight, bias and
running statistics, as O2 keeps them; a ``half params`` variant has them in the activations'
dtype), ReLU on and off, residual on and off. Shapes: channels_last unless named: odd channel
counts (C = 3, 7: the kernels' scalar path), C = 1, C = 200 (several channel slices, the last
partial), N*H*W = 2, a 2-D [N, C] input, a ResNet-like [32, 64, 28, 28], a mean far from zero
(the statistics' shifted sums), no affine parameters, and an NCHW input (the PyTorch fallback
on CUDA). ``dispatch`` variants run the op under a pass-through ``TorchDispatchMode``: the
registered op's path (``torch.compile``'s), running statistics updated from its mean and
invstd, where plain calls take the eager path.

The ``layout`` output must match exactly: y keeps the input's memory format. Under ReLU the
incoming gradient is zero where |bn(x) + residual| < 1e-3 (float64): at the kink the mask
follows the rounding of y, and one element taking the other side moves a small tensor's
gradients by more than any bound. With N*H*W = 2 the normalised values are +-1 up to eps and dx
is proportional to eps / var, so that shape takes eps = 0.5 (at 1e-5 dx is all cancellation,
for torch's fp32 too).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.harness import Case, Spec, register
from aiak.conformance.shapes import draw
from aiak.ops.batch_norm_act import batch_norm_act

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MOMENTUM = 0.1
_KINK = 1e-3  # |y| before the ReLU below which the incoming gradient is zeroed

# (label, shape, extra params): channels_last 4-D unless "nchw"; every (relu, residual).
_SHAPES = (
    ("C3", (6, 3, 5, 7), {}),
    ("C7", (4, 7, 9, 5), {}),
    ("C1", (8, 1, 4, 4), {}),
    ("C200", (16, 200, 3, 3), {}),
    ("NHW2", (1, 8, 2, 1), {"eps": 0.5}),
    ("2-D", (96, 40), {}),
    ("resnet 32x64x28x28", (32, 64, 28, 28), {}),
)
# (label, shape, extra params): relu and residual on only.
_EXTRA = (
    ("mean 30", (8, 16, 10, 10), {"offset": 30.0}),
    ("no affine", (6, 24, 5, 5), {"affine": False}),
    ("half params", (6, 24, 5, 5), {"half_params": True}),
    ("nchw", (4, 16, 6, 6), {"nchw": True}),
    ("dispatch C7", (4, 7, 9, 5), {"dispatch": True}),
    ("dispatch 2-D", (96, 40), {"dispatch": True}),
    ("dispatch resnet 32x64x28x28", (32, 64, 28, 28), {"dispatch": True}),
)


def _specs(device: torch.device) -> list[Spec]:
    specs = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for label, shape, extra in _SHAPES:
            for relu in (True, False):
                for residual in (True, False):
                    act = ("+res " if residual else "") + ("relu" if relu else "no relu")
                    specs.append(
                        Spec(
                            f"{label} {act} {_NAMES[dtype]}",
                            dtype,
                            {"shape": shape, "relu": relu, "residual": residual, **extra},
                            bench=label.startswith("resnet") and dtype == torch.float16,
                        )
                    )
        for label, shape, extra in _EXTRA:
            if extra.get("half_params") and dtype == torch.float32:
                continue
            specs.append(
                Spec(
                    f"{label} +res relu {_NAMES[dtype]}",
                    dtype,
                    {"shape": shape, "relu": True, "residual": True, **extra},
                )
            )
    return specs


def _reference_forward(x, weight, bias, residual, rm, rv, eps, relu):
    y = F.batch_norm(x, rm, rv, weight, bias, True, _MOMENTUM, eps)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if relu else y


def _inputs(spec: Spec, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    p = spec.params
    shape, dtype = p["shape"], spec.dtype
    c = shape[1]
    fmt = torch.channels_last if len(shape) == 4 and not p.get("nchw") else torch.contiguous_format

    def act(offset: float = 0.0) -> torch.Tensor:
        return (draw(shape, gen, device) + offset).to(dtype).contiguous(memory_format=fmt)

    pdtype = dtype if p.get("half_params") else torch.float32
    affine = p.get("affine", True)
    inp = {
        "x": act(p.get("offset", 0.0)),
        "residual": act() if p["residual"] else None,
        "weight": (1.0 + 0.3 * draw(c, gen, device)).to(pdtype) if affine else None,
        "bias": (0.3 * draw(c, gen, device)).to(pdtype) if affine else None,
        "running_mean": (0.5 * draw(c, gen, device)).to(pdtype),
        "running_var": (0.5 + draw(c, gen, device).abs()).to(pdtype),
        "dout": act(),
        "eps": p.get("eps", 1e-5),
        "relu": p["relu"],
        "format": fmt,
        "dispatch": p.get("dispatch", False),
    }
    if p["relu"]:
        with torch.no_grad():
            pre = _reference_forward(*_doubles(inp), inp["eps"], False)  # before the ReLU
        inp["dout"] = torch.where(pre.abs() < _KINK, 0.0, inp["dout"].double()).to(dtype)
        inp["dout"] = inp["dout"].contiguous(memory_format=fmt)
    return inp


def _doubles(inp: dict[str, Any]) -> list[torch.Tensor | None]:
    """x, weight, bias, residual, running mean and variance as fresh float64 tensors."""
    names = ("x", "weight", "bias", "residual", "running_mean", "running_var")
    return [inp[n].double().clone() if inp[n] is not None else None for n in names]


def _leaves(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [t.requires_grad_() if t is not None else None for t in tensors]


def _outputs(y, x, weight, bias, residual, rm, rv, fmt) -> dict[str, torch.Tensor]:
    out = {"y": y.detach(), "dx": x.grad}
    if weight is not None:
        out["dweight"] = weight.grad
    if bias is not None:
        out["dbias"] = bias.grad
    if residual is not None:
        out["dresidual"] = residual.grad
    out["running_mean"], out["running_var"] = rm, rv
    out["layout"] = torch.tensor([float(y.is_contiguous(memory_format=fmt))])
    return out


def _reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    x, w, b, res, rm, rv = _doubles(inp)
    x, w, b, res = _leaves([x, w, b, res])
    y = _reference_forward(x, w, b, res, rm, rv, inp["eps"], inp["relu"])
    y.backward(inp["dout"].double())
    out = _outputs(y, x, w, b, res, rm, rv, torch.contiguous_format)
    out["layout"] = torch.ones(1)  # the input's format, whatever float64's strides are
    return out


class _PassThrough(TorchDispatchMode):
    """Every op through the dispatcher, unchanged: the op's registered path, not the eager one."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _run(inp: dict[str, Any], fn) -> dict[str, torch.Tensor]:
    """``fn(x, running_mean, running_var, weight, bias, residual, eps, relu)`` and its
    backward on fresh copies of the inputs: the candidate and the baseline alike."""
    names = ("x", "weight", "bias", "residual", "running_mean", "running_var")
    x, w, b, res, rm, rv = (inp[n].clone() if inp[n] is not None else None for n in names)
    x, w, b, res = _leaves([x, w, b, res])
    with _PassThrough() if inp["dispatch"] else contextlib.nullcontext():
        y = fn(x, rm, rv, w, b, res, inp["eps"], inp["relu"])
        y.backward(inp["dout"])
    return _outputs(y, x, w, b, res, rm, rv, inp["format"])


def _ours(x, rm, rv, w, b, res, eps, relu):
    return batch_norm_act(x, rm, rv, w, b, True, _MOMENTUM, eps, res, relu)


def _torchvision(x, rm, rv, w, b, res, eps, relu):
    """torchvision's spelling: ``out = bn(x)``, ``out += identity``, ``relu_(out)``."""
    out = F.batch_norm(x, rm, rv, w, b, True, _MOMENTUM, eps)
    if res is not None:
        out += res
    return torch.relu_(out) if relu else out


def _candidate(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    return _run(inp, _ours)


def _baseline(inp: dict[str, Any]) -> None:
    _run(inp, _torchvision)


register(
    Case(
        name="ops.batch_norm_act",
        specs=_specs,
        make_inputs=_inputs,
        candidate=_candidate,
        reference=_reference,
        baseline=_baseline,
        exact=("layout",),
        description="training-mode batch norm + residual + ReLU: y, gradients of input, "
        "weight, bias and residual, running statistics after one call vs F.batch_norm + add + "
        "relu in float64; baseline torchvision's bn, += identity, relu_ in the same dtype",
    )
)
