"""Argument checks of :func:`aiak.comm.dgc` and of a clipping rule with its parameters
(``clip_grad_func`` / ``clip_grad_func_params`` of ``dgc`` and :func:`aiak.comm.overlap_step`),
made when the hook is built: a missing or misspelt parameter would otherwise fail at the first
backward, inside the communication hook. The checks themselves are aiak.ops' (``_args``),
imported on first use so that ``import aiak.comm`` stays lean.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_clip", "check_dgc_options"]

# the keys dgc's clipping reads: (required, optional) per built-in rule
DGC_CLIP_KEYS = {"norm": ({"max_norm"}, {"norm_type"}), "value": ({"clip_value"}, set())}
_FLAGS = (
    "strided_sample",
    "resample",
    "fp16_values",
    "int32_indices",
    "nesterov",
    "momentum_masking",
)


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


def check_dgc_options(**options: Any) -> dict[str, Any]:
    """:func:`aiak.comm.dgc`'s arguments, checked, as plain floats, ints and bools."""
    from aiak.ops._args import check_bool, check_float, check_int

    op = "dgc"
    out = dict(options)
    for name, low, high, open_low, open_high in (
        ("compress_ratio", 0, 1, True, False),
        ("sample_ratio", 0, 1, True, False),
        ("compress_lower_bound", 0, 1, True, True),
        ("momentum", 0, 1, False, True),
    ):
        out[name] = check_float(
            name,
            options[name],
            gt=low if open_low else None,
            ge=None if open_low else low,
            lt=high if open_high else None,
            le=None if open_high else high,
            op=op,
        )
    if out["sample_ratio"] < 0.01:
        # DGC's reference floors it so: fewer samples make the threshold estimate too noisy
        warnings.warn(
            f"dgc: sample_ratio {out['sample_ratio']} is raised to 0.01, DGC's floor",
            UserWarning,
            stacklevel=3,
        )
        out["sample_ratio"] = 0.01
    out["compress_upper_bound"] = check_float(
        "compress_upper_bound", options["compress_upper_bound"], gt=1, op=op
    )
    out["max_adaptation_iters"] = check_int(
        "max_adaptation_iters", options["max_adaptation_iters"], ge=0, le=20, op=op
    )
    # -1 and 0: no warm-up
    warmup_epochs = out["warmup_epochs"] = check_int(
        "warmup_epochs", options["warmup_epochs"], ge=-1, op=op
    )
    coeff = options["warmup_coeff"]
    if isinstance(coeff, (list, tuple)):
        coeff = [
            check_float(f"warmup_coeff[{i}]", c, gt=0, le=1, op=op) for i, c in enumerate(coeff)
        ]
        if len(coeff) < warmup_epochs:
            raise ValueError(
                f"dgc: warmup_coeff as a list needs {warmup_epochs} ratios in (0, 1], got {coeff}"
            )
    elif coeff is not None:
        coeff = check_float("warmup_coeff", coeff, gt=0, le=1, op=op)
    out["warmup_coeff"] = coeff
    for name in _FLAGS:
        out[name] = check_bool(name, options[name], op=op)
    func = options["clip_grad_func"]
    if func not in (None, "norm", "value") and not callable(func):
        raise ValueError(
            f"dgc: clip_grad_func must be 'norm', 'value', a callable or None, got {func!r}"
        )
    out["clip_grad_func_params"] = check_clip(
        op, func, options["clip_grad_func_params"], DGC_CLIP_KEYS
    )
    return out
