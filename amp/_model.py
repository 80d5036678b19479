"""The model side of O2: cast a model to half (BatchNorm kept fp32 if asked), and the forward
hooks that cast its inputs to half, its outputs to fp32, and run it with autocast off."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["HALF_DTYPES", "cast_model", "install_forward_casts"]

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


def _autocast_off() -> contextlib.ExitStack | None:
    """Turn autocast off for every device type it is on for; None (nothing entered) when it is
    on for none, the common case outside an autocast region (a few probes, no context)."""
    on = [device_type for device_type, enabled in _AUTOCAST_PROBES if enabled()]
    if not on:
        return None
    with contextlib.ExitStack() as entered:
        for device_type in on:
            entered.enter_context(torch.autocast(device_type, enabled=False))
        return entered.pop_all()  # all entered: the caller exits them


class _AutocastOffStack(threading.local):
    """One model's entered autocast-off contexts, innermost last. Per thread, as autocast's
    state is: DataParallel replicas share the hooks and run in threads of their own."""

    def __init__(self) -> None:
        self.stack: list[contextlib.ExitStack | None] = []


def install_forward_casts(model: nn.Module, dtype: torch.dtype, autocast_off: bool) -> None:
    """Forward hooks: floating inputs -> ``dtype``, half outputs -> fp32 and, if
    ``autocast_off``, autocast disabled from after the input cast to after the output cast."""

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    def cast_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floating(output, torch.float32, only=HALF_DTYPES)

    if not autocast_off:
        model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
        model.register_forward_hook(cast_outputs)
        return

    local = _AutocastOffStack()

    def cast_inputs_then_autocast_off(
        module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        cast = cast_inputs(module, args, kwargs)
        # One entry per call, None included: a nested call of this model (autocast is already
        # off there) pops its own entry, not its caller's.
        local.stack.append(_autocast_off())
        return cast

    def restore_autocast(module: nn.Module, args: tuple, output: Any) -> None:
        # always_call: torch runs this when forward (or a later hook) raises, too. When a
        # pre-hook that runs before ours raised, ours pushed nothing: the stack is empty then
        # (in a nested call this would pop the caller's entry: autocast would come back early).
        stack = local.stack
        if stack:
            entered = stack.pop()
            if entered is not None:
                entered.close()

    model.register_forward_pre_hook(cast_inputs_then_autocast_off, with_kwargs=True)
    model.register_forward_hook(cast_outputs)  # runs first: outputs are cast, then autocast back
    model.register_forward_hook(restore_autocast, always_call=True)
