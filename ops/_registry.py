"""Declaring an ``aiak::`` op: schema, PyTorch reference, CUDA kernel, fake — in one call.

Why ``torch.library.define`` + ``Library.impl`` and not ``torch.library.custom_op``: custom_op
wraps every call in Python layers (autograd, in-place-or-view bookkeeping with one version bump
per tensor, alias checks) that cost about four times define/impl's host time per call on a list
of a few hundred tensors (389 tensors, an empty kernel: 340 against 87 µs); define/impl
dispatches from C++ straight to the Python kernel. What custom_op gives is kept: the reference
is the default kernel on every device (``CompositeExplicitAutograd``), ``register_fake`` for
``torch.compile``, ``register_autograd`` where an op has a gradient, ``opcheck`` passes, and
version counters of the arguments a kernel writes (``Tensor(a!)`` in the schema) are bumped
by one C++ call.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from aiak.ops import _host

LIB = torch.library.Library("aiak", "FRAGMENT")


@dataclasses.dataclass(frozen=True)
class Op:
    """A declared op: ``overload`` is ``torch.ops.aiak.<name>.default``; calling the Op itself
    takes the eager fast path; ``Args`` is the op's argument record (a NamedTuple made from the
    schema, field for field: the schema is the one place the arguments are written).

    The fast path calls a kernel straight from Python when nothing needs the dispatcher: plain
    (or Parameter) tensors, no ``torch.compile`` tracing, no ``TorchDispatchMode`` (fake tensors,
    functionalization), and for a differentiable op no grad mode. Then CUDA tensors run ``cuda``
    and others the reference, exactly the kernels the dispatcher would pick. Going through
    ``torch.ops`` converts every tensor of every list to a C++ value and back (about four times a
    ResNet-50-sized optimizer kernel's GPU time for a 6-list step over 161 tensors); everything
    else the dispatcher would do here is done the same way (version counters of written tensors,
    one C++ call).
    """

    overload: Any
    cuda: Callable[..., Any] | None
    written: tuple[int, ...]
    differentiable: bool
    reference: Callable[..., Any] | None = None
    Args: Any = None
    binder: Callable[..., Any] | None = None

    def bind(
        self,
        params: list[torch.Tensor],
        rest: Any,
        conform: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> Any:
        """This op with ``params`` and every list after the grads (``rest``, up to
        ``copy_to``) bound: ``bound(grads, *scalars)`` is ``op(params, grads, *rest,
        *scalars)``, kept O(1) in Python per call while the tensors stay put (the fused
        optimizer ops: ``ops/_fused.py`` ``Bound``). ``conform(grads)`` checks or adapts grads
        that fail the fast path's checks (default: as they are)."""
        if self.binder is None:
            raise TypeError(f"{self.overload._schema.name} cannot be bound")
        return self.binder(self, params, rest, conform)

    def __call__(self, *args: Any) -> Any:
        kernel = self.eager_kernel(args)
        if kernel is None:
            return self.overload(*args)
        out = kernel(*args)
        for i in self.written:
            increment_version(args[i])
        return out

    def eager_kernel(self, args: tuple, autograd: bool = True) -> Callable[..., Any] | None:
        """The kernel the fast path calls for ``args``, or None (then the dispatcher).
        ``autograd=False``: the caller runs the op under ``torch.no_grad()``, so grad mode and
        requires-grad need no check (a pass over every tensor of a list)."""
        first = args[0] if args else None
        if isinstance(first, (list, tuple)):
            first = first[0] if first else None
        if type(first) not in _PLAIN:
            if isinstance(first, torch.Tensor) or torch.compiler.is_compiling():
                return None  # a tensor subclass (fake, functional...): the dispatcher's job
            # Not a tensor at all (or empty lists): the reference's checks name the argument,
            # where the dispatcher would raise a RuntimeError about C++ types.
            return self.reference if _current_dispatch_mode() is None else None
        # With no tensor requiring grad the dispatcher's autograd layer would return the
        # kernel's outputs unchanged, so grad mode alone does not send a call there.
        # is_compiling first: torch.compile cannot trace into the compiled helper.
        if (
            torch.compiler.is_compiling()
            or _current_dispatch_mode() is not None
            or (
                autograd
                and self.differentiable
                and torch.is_grad_enabled()
                and _host.any_requires_grad(args)
            )
        ):
            return None
        if first.is_cuda:
            return self.cuda
        return self.reference if first.device.type == "cpu" else None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def define(
    schema: str,
    reference: Callable[..., Any],
    *,
    cuda: Callable[..., Any] | None = None,
    fake: Callable[..., Any] | None = None,
    differentiable: bool = False,
    binder: Callable[..., Any] | None = None,
) -> Op:
    """Declare ``aiak::<schema>``; returns the :class:`Op` (``.overload`` is the
    ``torch.ops.aiak.<name>.default`` overload).

    ``reference`` runs on every device without a kernel of its own (CPU included); ``cuda``
    is the CUDA kernel; ``fake`` computes output metadata for tracing; ``differentiable``: an
    autograd formula is registered (``torch.library.register_autograd``) by the caller;
    ``binder``: what :meth:`Op.bind` calls.
    """
    name = schema.split("(", 1)[0]
    qualname = f"aiak::{name}"
    torch.library.define(qualname, schema[len(name) :], lib=LIB)
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    written = _written_arguments(qualname)
    if cuda is not None:
        LIB.impl(name, _bumping_versions(cuda, written) if written else cuda, "CUDA")
    if fake is not None:
        torch.library.register_fake(qualname, fake, lib=LIB)
    overload = getattr(torch.ops.aiak, name).default
    return Op(overload, cuda, written, differentiable, reference, record(schema), binder)


@functools.cache
def record(schema: str) -> Any:
    """The argument record of ``schema``: a NamedTuple with one field per argument, in the
    schema's order (the same class for the same schema, before and after :func:`define`)."""
    name = schema.split("(", 1)[0]
    names = [arg.name for arg in torch._C.parse_schema("aiak::" + schema).arguments]
    return collections.namedtuple(_camel(name) + "Args", names)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _written_arguments(qualname: str) -> tuple[int, ...]:
    """Positions of the arguments the schema marks as written (``Tensor(a!)``)."""
    namespace, name = qualname.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    return tuple(
        i
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _bumping_versions(kernel: Callable[..., Any], written: tuple[int, ...]) -> Callable[..., Any]:
    """A kernel that writes through raw pointers must tell autograd, as in-place torch ops do:
    a tensor saved for backward and then overwritten makes backward raise instead of silently
    using the new values."""

    @functools.wraps(kernel)
    def wrapped(*args: Any) -> Any:
        out = kernel(*args)
        for i in written:
            increment_version(args[i])
        return out

    return wrapped


def increment_version(value: torch.Tensor | list[torch.Tensor]) -> None:
    """Bump the version counter of a tensor or of every tensor of a list (one C++ call)."""
    try:
        _increment([value] if isinstance(value, torch.Tensor) else value)
    except TypeError:  # torch releases whose increment_version takes a single tensor
        for t in [value] if isinstance(value, torch.Tensor) else value:
            torch.autograd.graph.increment_version(t)


_increment = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)
