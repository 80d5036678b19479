"""What aiak-advise's probe reads from the training process: the optimizer's facts, the
autocast the forward runs under, who called ``step()``, the window attention ``swin.convert``
would fuse (the probe, ``_advise_probe``, records them in its report)."""

from __future__ import annotations

import sys
from typing import Any


def length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def autocast_of(torch: Any) -> str | None:
    """The autocast the forward runs under: ``"cuda:float16"``, ``"cpu:bfloat16"``, or None."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return f"{device}:{str(torch.get_autocast_dtype(device)).replace('torch.', '')}"
    return None


def optimizer_facts(opt: Any) -> dict[str, Any]:
    params = [p for g in opt.param_groups for p in g["params"]]
    group = opt.param_groups[0] if opt.param_groups else {}
    return {
        "aiak_o2": getattr(opt, "_aiak_amp", None) is not None,
        # GradScaler hands the inf check to such an optimizer: no .item() before its step
        "amp_scaling": bool(getattr(opt, "_step_supports_amp_scaling", False)),
        "momentum": _number(group.get("momentum")),
        "weight_decay": _number(group.get("weight_decay")),
        "nesterov": bool(group.get("nesterov", False)),
        "type": type(opt).__name__,
        "module": type(opt).__module__,
        "groups": len(opt.param_groups),
        "tensors": len(params),
        "parameters": int(sum(p.numel() for p in params)),
        "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
        "foreach": opt.defaults.get("foreach"),
        "fused": opt.defaults.get("fused"),
        "shapes": [list(p.shape) for p in params][:4096],
        "device": str(params[0].device.type) if params else "cpu",
    }


def _number(value: Any) -> float:
    """A hyper-parameter as a float (0.0 when absent or not a number: a custom optimizer)."""
    try:
        return float(value or 0.0)
    except (TypeError, ValueError, RuntimeError):
        return 0.0


def stepped_by_grad_scaler() -> bool:
    """Whether the optimizer's step() was called by torch's GradScaler.step (the caller of the
    step hook, a few frames up): it reads ``found_inf`` on the host first, unless the
    optimizer takes the inf check itself (``_step_supports_amp_scaling``)."""
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_filename.replace("\\", "/").endswith("amp/grad_scaler.py"):
            return True
    return False


def window_attention_modules(roots: Any) -> tuple[list[Any], int, int]:
    """What ``aiak.ops.swin.convert`` finds under ``roots`` (its own recognition): the window
    attention it would fuse, the count already fused, the count it leaves for their dropout."""
    from aiak.ops.swin import find_window_attention

    return find_window_attention(*roots)
