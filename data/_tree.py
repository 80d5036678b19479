"""Walk the tensors of a nested batch: tuples, lists, dicts, namedtuples and dataclasses.

Everything else (strings, numbers, arrays, user objects) is a leaf that passes through
untouched, so a loader may yield any mixture of tensors and metadata.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor, str], torch.Tensor], obj: Any, path: str = "") -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t, path)``; containers keep their types.

    ``path`` names where the tensor sits (``[0]['image']``) so errors can point at it.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj, path or "batch")
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v, f"{path}.{k}") for k, v in zip(obj._fields, obj)))
    if isinstance(obj, (list, tuple)):
        out = [map_tensors(fn, v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(out) if type(obj) in (list, tuple) else _same(obj, out)
    if isinstance(obj, dict):
        items = {k: map_tensors(fn, v, f"{path}[{k!r}]") for k, v in obj.items()}
        if type(obj) is dict:
            return items
        clone = copy.copy(obj)  # dict subclasses (OrderedDict, defaultdict, ...) keep their type
        clone.update(items)
        return clone
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = copy.copy(obj)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            # object.__setattr__ also works on frozen dataclasses.
            object.__setattr__(clone, f.name, map_tensors(fn, value, f"{path}.{f.name}"))
        return clone
    return obj


def _same(obj: list | tuple, items: list) -> Any:
    """A list/tuple subclass rebuilt from ``items``; left as it was if it cannot be rebuilt."""
    try:
        return type(obj)(items)
    except TypeError:
        return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested batch, in the order ``map_tensors`` visits them."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor, _path: str) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(visit, obj)
    return iter(found)
