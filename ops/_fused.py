"""What the fused optimizer ops (``fused_adam_``, ``fused_sgd_``, ``fused_lamb_``) share.

- :class:`Kernel`: an op's CUDA side as data (its table lists, checks, launcher, reference);
  :func:`cuda_impl` turns one into the op's ``cuda`` kernel.
- :class:`Bound`: an op with every list but the grads bound, the optimizers' per-step path.
- Kernel flag bits, read from ``kernels/optim_common.cuh`` (their one source).
- The references' helpers: fp32 working copies of half tensors, the found_inf guard, the
  per-step coefficients.

Conventions of all three ops (state tensors have the param's dtype and layout, as in torch's
fused optimizers; arithmetic is fp32, float64 for float64 params on the reference):

- ``state_steps``: one-element float32 tensors on the device; the op advances them by one.
- ``grad_scale`` / ``found_inf`` (GradScaler): grads are divided by ``grad_scale`` (and written
  back unscaled where the op writes grads); when ``found_inf != 0`` nothing at all is written,
  step counters included. Both are read on the device: no host synchronisation.
- ``lr_tensor`` (capturable): when given, the learning rate is read from it on the device.
- ``copy_to`` (amp copy-back): empty, or one tensor per parameter that receives the updated
  parameter converted to its own dtype in the same pass; an empty tensor means "no copy".
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from aiak.ops import _cuda, _host, _mta
from aiak.ops._capability import (
    Capability,
    check_scalar_tensor,
    declare,
    is_dense,
    same_layouts,
    use_kernel,
)
from aiak.ops._registry import Op, increment_version

_DEFINES = _cuda.defines("optim_common.cuh")
BLOCK = _DEFINES["BLOCK"]  # threads per chunk block
HALF_DTYPES = (torch.float16, torch.bfloat16)
Tensors = Sequence[torch.Tensor]


def flags(**on: bool) -> int:
    """The kernel's flag word: ``flags(adamw=True)`` is ``F_ADAMW`` of optim_common.cuh."""
    return sum(_DEFINES["F_" + name.upper()] for name, value in on.items() if value)


_nulls: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def copy_list(copy_to: Tensors, n: int, device: torch.device) -> list[torch.Tensor]:
    """``copy_to``, or n empty tensors (null pointers: "no copy") when it is empty."""
    if copy_to:
        return list(copy_to)
    found = _nulls.get((device, n))
    if found is None:
        found = _nulls[(device, n)] = [torch.empty(0, device=device)] * n
    return found


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One fused op's CUDA side. ``lists(a)``: the device table's lists, in the kernel's order;
    ``check(a)``: every check (raises naming the argument; returns the device);
    ``check_scalars(a)``: the checks a validated tensor set still needs per call;
    ``launch(a, table)``; ``reference(a)``: the op's one math in PyTorch."""

    cap: Capability
    lists: Callable[[Any], list]
    check: Callable[[Any], object]
    check_scalars: Callable[[Any], object]
    launch: Callable[[Any, _mta.Table], None]
    reference: Callable[[Any], None]

    def __post_init__(self) -> None:
        KERNELS[self.cap.name] = self


KERNELS: dict[str, Kernel] = {}


def bind(
    op: Op,
    params: list[torch.Tensor],
    rest: Sequence[list[torch.Tensor]],
    conform: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> Bound:
    """``op`` (``fused_adam_``, ``fused_sgd_`` or ``fused_lamb_``) with ``params`` and the lists
    after the grads (``rest``, up to ``copy_to``) bound: see :class:`Bound`. ``conform(grads)``
    checks or adapts grads that fail the fast path's checks (default: as they are)."""
    kernel = KERNELS[op.overload._schema.name.removeprefix("aiak::")]
    return Bound(op, kernel, params, rest, conform or _as_they_are)


def _as_they_are(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return grads


_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_stride = torch.Tensor.stride


def kernel_table(k: Kernel, a: Any) -> _mta.Table | None:
    """The device table for ``a``'s lists, or None when the reference must run instead.

    A set validated before is found in the host cache (``_mta``) and only its scalars are
    checked; anything else is checked in full first (per-tensor checks cost more host time
    than a small model's kernel: they run once per tensor set)."""
    lists = k.lists(a)
    tab = _mta.cached(k.cap.name, lists)
    if tab is not None:
        k.check_scalars(a)
        if use_kernel(k.cap, tab.data.device, tab.dtypes):
            return tab
        return None
    device = k.check(a)
    dtypes = set(map(_dtype, a.params)) | set(map(_dtype, a.copy_to))
    if not use_kernel(k.cap, device, dtypes, (a, lists)):
        return None
    with _cuda.on_device(device):
        return _mta.table(lists, device, k.cap.name)


LAYOUT_CONDITIONS = (
    "params dense (contiguous, channels_last, a transpose...)",
    "every list laid out as the params",
)


def layout_reasons(op: str) -> Callable[[Any, list], list[str]]:
    """The fused op ``op``'s layout reasons (``Capability.input_reasons``) for its record and
    its table's lists: the kernels walk every list's memory linearly, in the params' order."""

    def reasons(a: Any, lists: list) -> list[str]:
        if not (all(map(_is_contiguous, a.params)) or all(map(is_dense, a.params))):
            return [f"{op}: a param is a strided view (not dense)"]
        if not same_layouts([ts for ts in lists if ts is not getattr(a, "state_steps", None)]):
            return [f"{op}: a list is laid out unlike the params (other strides)"]
        return []

    return reasons


def capability(op: str) -> Capability:
    """The declared capability of fused op ``op``: the default dtypes, and its layouts."""
    return declare(Capability(op, input_reasons=layout_reasons(op), conditions=LAYOUT_CONDITIONS))


def cuda_impl(k: Kernel, fields: type) -> Callable[..., None]:
    """The op's CUDA kernel: the launch over the (cached) table, else the reference."""

    def kernel(*args: object) -> None:
        a = fields(*args)
        if not a.params:
            k.check(a)
            return
        tab = kernel_table(k, a)
        if tab is None:
            k.reference(a)
            return
        with _cuda.on_device(tab.data.device):
            k.launch(a, tab)

    return kernel


def check_scalar_tensors(op: str, a: Any, **tensors: torch.Tensor | None) -> None:
    """One-element fp32 tensors (or None) on the params' device: the kernels read them through
    their addresses, so a CPU tensor here would be a host pointer on the device."""
    first = a.params[0] if isinstance(a.params, (list, tuple)) and a.params else None
    if not isinstance(first, torch.Tensor):
        return  # no device to compare with; the list checks name any culprit
    device = first.device
    for name, t in tensors.items():
        if t is not None:
            check_scalar_tensor(op, name, t, device, torch.float32)


def positional(fn: Callable[[Any], object], fields: type) -> Callable[..., None]:
    """A kernel taking the op's arguments positionally, from one taking its record."""

    def kernel(*args: object) -> None:
        fn(fields(*args))

    return kernel


class Bound:
    """``op`` with every list but the grads bound: ``bound(grads, *scalars)`` is
    ``op(params, grads, *rest, *scalars)``, the same kernel and reference.

    It is what keeps an optimizer step O(1) in Python when the tensor set is stable: on eager
    CUDA it keeps the device table of its last launch and, per call, re-checks only what can
    move between steps — the grads' and params' addresses and the grads' layout: one C++ call
    (``ops/_host.py``) for contiguous params, two address passes and a stride pass otherwise —
    before launching with the scalars checked. Anything else (CPU, tracing, a moved tensor, a
    new grad layout) runs ``conform(grads)`` (the owner's grad checks and layout copies) and
    the op's ordinary path, which finds or builds the table.

    Version counters: the params, ``copy_to`` and (when unscaled in place) the grads are bumped;
    the state lists are the owner's private memory.
    """

    __slots__ = (
        "_bump",
        "_contiguous",
        "_grad_ptrs",
        "_key",
        "_param_ptrs",
        "_strides",
        "_table",
        "conform",
        "kernel",
        "op",
        "params",
        "rest",
    )

    def __init__(
        self,
        op: Op,
        kernel: Kernel,
        params: list[torch.Tensor],
        rest: Sequence[list[torch.Tensor]],
        conform: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    ) -> None:
        self.op, self.kernel, self.params, self.rest = op, kernel, params, tuple(rest)
        self.conform = conform
        copy_to = self.rest[-1]
        self._bump = params + [t for t in copy_to if t.numel()]
        self._table: _mta.Table | None = None
        self._key: object = None
        self._grad_ptrs: tuple = ()
        self._param_ptrs: tuple = ()
        self._contiguous = all(map(_is_contiguous, params))
        self._strides = tuple(map(_stride, params))

    def __call__(self, grads: list[torch.Tensor], *scalars: object) -> None:
        tab = self._table
        if tab is not None and self._unmoved(grads):
            a = self.op.Args(self.params, grads, *self.rest, *scalars)
            self.kernel.check_scalars(a)
            if use_kernel(self.kernel.cap, tab.data.device, tab.dtypes):
                tab.wait()
                with _cuda.on_device(tab.data.device):
                    self.kernel.launch(a, tab)
                increment_version(self._bump if a.grad_scale is None else self._bump + grads)
                return
        grads = self.conform(grads)
        args = (self.params, grads, *self.rest, *scalars)
        if self.op.eager_kernel(args) is not self.op.cuda or self.op.cuda is None:
            self.op(*args)
            return
        a = self.op.Args(*args)
        tab = kernel_table(self.kernel, a) if self.params else None
        self._table = tab
        if tab is None:
            self.op(*args)
            return
        if self._contiguous:
            self._key = _host.layout_key((grads, self.params))
        else:
            self._grad_ptrs = tuple(map(_data_ptr, grads))
            self._param_ptrs = tuple(map(_data_ptr, self.params))
        with _cuda.on_device(tab.data.device):
            self.kernel.launch(a, tab)
        increment_version(self._bump if a.grad_scale is None else self._bump + grads)

    def _unmoved(self, grads: list[torch.Tensor]) -> bool:
        if self._contiguous:  # the kernel needs the grads laid out as the params: contiguous
            key = _host.layout_key((grads, self.params))
            return key is not None and key == self._key
        try:
            if tuple(map(_data_ptr, grads)) != self._grad_ptrs:
                return False
        except (RuntimeError, TypeError):  # sparse grads have no data pointer; None
            return False
        if tuple(map(_data_ptr, self.params)) != self._param_ptrs:
            return False
        return tuple(map(_stride, grads)) == self._strides


# --------------------------------------------------------------------------------------------
# The references' helpers
# --------------------------------------------------------------------------------------------


def upcast(ts: Tensors) -> list[torch.Tensor]:
    """fp32 working copies of fp16/bf16 tensors (others as they are): the update is computed in
    fp32 and rounded once at the store, as the kernels do."""
    return [t.float() if t.dtype in HALF_DTYPES else t for t in ts]


def store(dst: Tensors, work: Tensors) -> None:
    """Write working copies back where ``upcast`` made a copy."""
    pairs = [(d, w) for d, w in zip(dst, work) if d is not w]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [w for _, w in pairs])


def copy_back(copy_to: Tensors, params: Tensors) -> None:
    pairs = [(d, p) for d, p in zip(copy_to, params) if d.numel()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [p for _, p in pairs])


def unless_found_inf(
    found_inf: torch.Tensor | None, mutated: Iterable[torch.Tensor], update: Callable[[], None]
) -> None:
    """Run ``update`` unless ``found_inf != 0``, leaving ``mutated`` untouched when skipped.

    On CPU the flag is read directly (no device to synchronise); on a GPU the update runs and
    each mutated tensor is then restored with torch.where: no host sync.
    """
    if found_inf is None:
        update()
        return
    if found_inf.device.type == "cpu":
        if found_inf.item() == 0:
            update()
        return
    mutated = list(mutated)
    saved = [t.clone() for t in mutated]
    update()
    skip = found_inf.reshape(()) != 0
    for t, old in zip(mutated, saved):
        t.copy_(torch.where(skip, old, t))


def coefficients(steps: Tensors, fn: Callable[[Any], Any]) -> list[Any]:
    """``fn(step)`` per tensor: Python floats when the steps live on the CPU (as torch's foreach
    optimizers compute them), 0-dim tensors otherwise (no host sync, like torch's capturable)."""
    if steps and steps[0].device.type == "cpu":
        return [fn(s.item()) for s in steps]
    return [fn(s) for s in steps]


def rate(lr: float, lr_tensor: torch.Tensor | None) -> float | torch.Tensor:
    """The learning rate the reference uses: ``lr``, or ``lr_tensor`` (read on the host only
    when it is a CPU tensor: no device to synchronise)."""
    if lr_tensor is None:
        return lr
    return lr_tensor.item() if lr_tensor.device.type == "cpu" else lr_tensor.reshape(())


def scale_of(grad_scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad_scale is None else grad_scale.reshape(())
