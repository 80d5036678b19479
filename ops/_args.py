"""Argument checks shared by aiak's public constructors and ops.

Each check returns the value in its plain Python form (``int``, ``float``, ``bool``) or raises
``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong range) whose message
starts with ``"{op}: {name}"``, so the error names the argument the caller passed. Python's
``bool`` is an ``int`` subclass and a string is truthy: the checks refuse both where a number
or a flag is meant, instead of reading ``True`` as 1 or ``'no'`` as ``True``.

aiak.optim, aiak.amp, aiak.comm and aiak.data may import this module (aiak.ops is their
common foundation); it imports nothing of aiak.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_float",
    "check_int",
    "check_sequence",
    "check_tensor",
]

T = TypeVar("T")


def _label(name: str, op: str | None) -> str:
    return f"{op}: {name}" if op else name


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _bounds(
    label: str, value: float, gt: float | None, ge: float | None, lt: float | None, le: float | None
) -> None:
    parts = []
    if gt is not None:
        parts.append(f"> {gt}")
    if ge is not None:
        parts.append(f">= {ge}")
    if lt is not None:
        parts.append(f"< {lt}")
    if le is not None:
        parts.append(f"<= {le}")
    ok = (
        (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )
    if not ok:
        raise ValueError(f"{label} must be {' and '.join(parts)}, got {value!r}")


def check_bool(name: str, value: Any, *, op: str | None = None) -> bool:
    """``value`` as a ``bool``; only ``True``/``False`` (and numpy's bools) are accepted."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{_label(name, op)} must be a bool (True or False), got {_shown(value)}")


def check_int(
    name: str,
    value: Any,
    *,
    gt: int | None = None,
    ge: int | None = None,
    lt: int | None = None,
    le: int | None = None,
    op: str | None = None,
) -> int:
    """``value`` as an ``int`` within the given bounds; a bool, float or string is refused."""
    label = _label(name, op)
    if isinstance(value, (bool, float, str, bytes, torch.Tensor)):
        raise TypeError(f"{label} must be an int, got {_shown(value)}")
    try:
        out = operator.index(value)  # int and numpy's integers
    except TypeError:
        raise TypeError(f"{label} must be an int, got {_shown(value)}") from None
    _bounds(label, out, gt, ge, lt, le)
    return out


def check_float(
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    finite: bool = True,
    allow_nan: bool = False,
    op: str | None = None,
) -> float:
    """``value`` (an int or a float) as a ``float`` within the given bounds.

    Infinities are refused unless ``finite=False``, NaN unless ``allow_nan=True`` (a NaN then
    skips the bounds).
    """
    label = _label(name, op)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label} must be a number, got {_shown(value)}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{label} is too large for a float, got {value!r}") from None
    if finite and (math.isinf(out) or (math.isnan(out) and not allow_nan)):
        raise ValueError(f"{label} must be finite, got {out}")
    if math.isnan(out):
        if allow_nan:
            return out
        raise ValueError(f"{label} must not be NaN")
    _bounds(label, out, gt, ge, lt, le)
    return out


def check_choice(name: str, value: Any, choices: Collection[T], *, op: str | None = None) -> T:
    """``value`` if it is one of ``choices`` (compared by type and value: ``True`` is not 1)."""
    for c in choices:
        if type(c) is type(value) and c == value:
            return c
    raise ValueError(f"{_label(name, op)} must be one of {list(choices)!r}, got {_shown(value)}")


def check_callable(name: str, value: Any, *, op: str | None = None) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(f"{_label(name, op)} must be callable, got {_shown(value)}")
    return value


def check_sequence(
    name: str, value: Any, *, nonempty: bool = False, op: str | None = None
) -> list[Any]:
    """``value`` (a list, tuple or other sequence, not a string) as a list."""
    label = _label(name, op)
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
        raise TypeError(f"{label} must be a list or tuple, got {_shown(value)}")
    out = list(value)
    if nonempty and not out:
        raise ValueError(f"{label} must not be empty")
    return out


def check_tensor(
    name: str,
    value: Any,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    ndim: int | tuple[int, ...] | None = None,
    op: str | None = None,
) -> torch.Tensor:
    """``value`` if it is a tensor of one of ``dtype``, on ``device``, with ``ndim`` dims."""
    label = _label(name, op)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{label} must be a tensor, got {_shown(value)}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if value.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{label} has dtype {value.dtype}, expected {want}")
    if device is not None and value.device != device:
        raise ValueError(f"{label} is on {value.device}, expected {device}")
    if ndim is not None:
        dims = ndim if isinstance(ndim, tuple) else (ndim,)
        if value.dim() not in dims:
            want = " or ".join(str(d) for d in dims)
            raise ValueError(f"{label} must have {want} dims, got shape {tuple(value.shape)}")
    return value
