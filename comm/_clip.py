"""The checks of a clipping rule and its parameters (``clip_grad_func`` /
``clip_grad_func_params`` of :func:`aiak.comm.dgc` and :func:`aiak.comm.overlap_step`), made
when the hook is built: a missing or misspelt parameter would otherwise fail at the first
backward, inside the communication hook.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_clip"]


def _norm_type(op: str, name: str, value: Any) -> None:
    from aiak.ops._args import check_float  # lazily: `import aiak.comm` stays lean

    if isinstance(value, str):  # torch's clip_grad_norm_ takes 'inf' too
        if value != "inf":
            raise ValueError(f"{op}: {name} must be a number > 0 or 'inf', got {value!r}")
        return
    check_float(name, value, gt=0, finite=False, op=op)


def check_clip(
    op: str,
    func: str | Callable[..., Any] | None,
    params: Mapping[str, Any] | None,
    keys: Mapping[str, tuple[set[str], set[str]]],
    target: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """``params`` as a dict, checked against ``func``.

    ``keys`` gives, per built-in rule name (``"norm"``, ``"value"``), its required and optional
    parameters; ``max_norm`` and ``clip_value`` must be numbers > 0, ``norm_type`` a number > 0
    or ``'inf'``. A callable ``func`` (or ``target``, the function a rule name stands for) must
    accept ``(gradients, **params)``.
    """
    from aiak.ops._args import check_float  # lazily: `import aiak.comm` stays lean

    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{op}: clip_grad_func_params must be a dict or None, got {type(params).__name__}"
        )
    bad = [k for k in params if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{op}: clip_grad_func_params' keys must be strings, got {bad!r}")
    params = dict(params)
    if func is None:
        if params:
            raise ValueError(
                f"{op}: clip_grad_func_params {sorted(params)} given without clip_grad_func"
            )
        return params
    if isinstance(func, str) and func in keys:
        required, optional = keys[func]
        missing = sorted(required - params.keys())
        if missing:
            raise ValueError(f"{op}: clip_grad_func={func!r} needs clip_grad_func_params {missing}")
        unknown = sorted(params.keys() - required - optional)
        if unknown and target is None:
            raise ValueError(
                f"{op}: clip_grad_func={func!r} takes clip_grad_func_params "
                f"{sorted(required | optional)}, not {unknown}"
            )
        for name in ("max_norm", "clip_value"):
            if name in params:
                value = check_float(
                    f"clip_grad_func_params[{name!r}]", params[name], gt=0, finite=False, op=op
                )
                if name == "clip_value" and math.isinf(value):
                    raise ValueError(f"{op}: clip_grad_func_params['clip_value'] must be finite")
        if "norm_type" in params:
            _norm_type(op, "clip_grad_func_params['norm_type']", params["norm_type"])
    fn = target if target is not None else func if callable(func) else None
    if fn is not None:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: checked at the call
            return params
        try:
            sig.bind(None, **params)
        except TypeError as e:
            name = getattr(fn, "__name__", repr(fn))
            raise TypeError(
                f"{op}: clip_grad_func_params {sorted(params)} do not fit "
                f"clip_grad_func {name}{sig}: {e}"
            ) from None
    return params
