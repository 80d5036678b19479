"""``Bound(fn, module)``: a module-level function bound to a module, set as an instance
attribute in place of one of its methods (``convert`` functions replace ``forward``-like
methods per instance). Unlike ``types.MethodType``, which pickles as ``getattr(module, name)``
and so cannot be loaded, it pickles and deep-copies with its module (``fn`` by its qualified
name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Bound"]


class Bound:
    def __init__(self, fn: Callable[..., Any], module: Any) -> None:
        self.fn = fn
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)
