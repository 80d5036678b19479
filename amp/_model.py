"""The model side of O2: cast a model to half (BatchNorm kept fp32 if asked), and the forward
wrapper that casts its inputs to half, its outputs to fp32, and run it with autocast off."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["HALF_DTYPES", "O2Forward", "cast_model", "install_forward_casts"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _cast_floating(
    obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None
) -> Any:
    """``obj`` with every floating tensor (of a dtype in ``only``, if given) cast to ``dtype``,
    through tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype and (only is None or obj.dtype in only):
            return obj.to(dtype)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floating(x, dtype, only) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(x, dtype, only) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype, only) for k, v in obj.items()}
    return obj


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast params and buffers to ``dtype`` in place, keeping each Parameter object (the
    optimizer, hooks and the user hold them) and, if asked, BatchNorm in fp32."""
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            # BatchNorm is fp32 whatever the model's dtype was (a float64 model too: its
            # float64 BatchNorm next to fp16 layers fails the first forward with mixed dtypes).
            keep = keep_batchnorm_fp32 and isinstance(module, nn.modules.batchnorm._BatchNorm)
            to = torch.float32 if keep else dtype
            for p in module._parameters.values():
                if p is None or id(p) in seen or not p.is_floating_point():
                    continue
                seen.add(id(p))
                if p.dtype != to:
                    p.data = p.data.to(to)
                    p.grad = None
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != to:
                    module._buffers[name] = b.to(to)


# Why the decorated model runs with autocast off: users keep the stock loop, ``with
# torch.autocast("cuda"): loss = loss_fn(model(x), y)``, and autocast stays active inside the
# half model. Its fp32-list ops (layer_norm, softmax, log_softmax, ...) then up-cast their fp16
# inputs, save fp32 activations for backward, and the next Linear casts back to fp16. On the H100,
# Swin-T O2 ran 58.5 ms/step that way against 43.2 ms for a pure-fp16 O2, with a higher peak
# memory than O1. Apex O2 runs the model purely in half precision, and so does decorate() unless
# patch_torch_functions=True. The loss, computed outside the model on its fp32 outputs, still
# runs under the user's autocast.
_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu", "mtia")


def _autocast_probes() -> tuple[tuple[str, Callable[[], bool]], ...]:
    """``(device_type, is autocast on for it?)`` for each device type this torch can autocast."""
    try:
        torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4: no device_type argument; only these two exist
        return (("cuda", torch.is_autocast_enabled), ("cpu", torch.is_autocast_cpu_enabled))
    probes = []
    for device_type in _AUTOCAST_DEVICES:
        try:
            torch.is_autocast_enabled(device_type)
        except (RuntimeError, TypeError, ValueError):  # not an autocast device in this build
            continue
        probes.append((device_type, functools.partial(torch.is_autocast_enabled, device_type)))
    return tuple(probes)


_AUTOCAST_PROBES = _autocast_probes()


def _autocast_on() -> tuple[str, ...]:
    """The device types autocast is on for (usually none: a few probes). Under
    ``torch.compile`` each probe is a constant that dynamo guards on, so a change of the user's
    autocast recompiles rather than runs the wrong graph."""
    return tuple(device_type for device_type, enabled in _AUTOCAST_PROBES if enabled())


def _run_without_autocast(
    device_types: tuple[str, ...], fn: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """``fn(*args, **kwargs)`` with autocast off for each of ``device_types``, restored when it
    returns or raises. Plain nested ``with`` blocks in one frame: dynamo traces them into the
    graph, where an ExitStack (or a context entered in one hook and left in another) breaks it.
    """
    if not device_types:
        return fn(*args, **kwargs)
    with torch.autocast(device_types[0], enabled=False):
        return _run_without_autocast(device_types[1:], fn, args, kwargs)


class O2Forward:
    """The decorated model's ``forward``: floating inputs -> ``dtype``, the wrapped forward
    (with autocast off for every device type it is on for, if ``autocast_off``), half outputs
    -> fp32.

    One wrapper around ``forward`` rather than forward hooks: it keeps the autocast-off region a
    ``with`` block, which ``torch.compile(model, fullgraph=True)`` traces with no graph break,
    and the module keeps no forward hook of its own, so an eager call takes
    ``nn.Module.__call__``'s fast path. Per-thread by construction (autocast's state is per
    thread; DataParallel replicas run in threads), and a nested call of the model restores only
    what it turned off. ``__wrapped__`` is the original forward: ``inspect.signature`` of the
    decorated model's forward is the original one.
    """

    def __init__(self, forward: Callable[..., Any], dtype: torch.dtype, autocast_off: bool):
        functools.update_wrapper(self, forward)
        self.dtype = dtype
        self.autocast_off = autocast_off

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dtype = self.dtype
        args, kwargs = _cast_floating(args, dtype), _cast_floating(kwargs, dtype)
        if self.autocast_off:
            out = _run_without_autocast(_autocast_on(), self.__wrapped__, args, kwargs)
        else:
            out = self.__wrapped__(*args, **kwargs)
        return _cast_floating(out, torch.float32, only=HALF_DTYPES)


def install_forward_casts(model: nn.Module, dtype: torch.dtype, autocast_off: bool) -> None:
    """``model.forward`` becomes an :class:`O2Forward` around the forward it had."""
    model.forward = O2Forward(model.forward, dtype, autocast_off)
