"""``aiak::multi_tensor_l2norm``: the L2 norm of a whole tensor list (and of each tensor), fp32.

One CUDA launch (``kernels/multi_tensor_l2norm.cu``) over the list's device table
(``ops/_mta.py``): per-chunk partial sums, reduced per tensor and overall by the last blocks to
finish, in a fixed order (the result is deterministic). Differentiable (``register_autograd``).
Read top-down: reference, CUDA launcher, the op with its fake and autograd formula, the Python
convenience.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from aiak.ops import _cuda, _mta
from aiak.ops._capability import (
    REFERENCE_DTYPES,
    Capability,
    check_tensor_list,
    declare,
    is_dense,
    use_kernel,
)
from aiak.ops._driver import Kernel
from aiak.ops._registry import LIB, define

__all__ = ["BoundNorm", "multi_tensor_l2norm"]

CAP = declare(Capability("multi_tensor_l2norm"))
_NORM = Kernel(
    "multi_tensor_l2norm.cu",
    "mt_l2norm",
    "ptr table, i32 T, ptr scratch, ptr per_tensor, ptr total",
)
_TAG = "multi_tensor_l2norm"  # the op's tables in the host cache
_dtype = operator.attrgetter("dtype")
_BLOCK = 512  # threads per chunk block; __launch_bounds__(512) in the source


def _norms_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One fp32 L2 norm per tensor, stacked (float64 tensors: computed in float64)."""
    return torch.stack(
        [
            torch.linalg.vector_norm(
                t, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32
            ).float()
            for t in tensors
        ]
    )


def _l2norm_reference(
    tensors: Sequence[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, REFERENCE_DTYPES)
    if not tensors:
        return torch.zeros((), dtype=torch.float32), torch.zeros(0, dtype=torch.float32)
    norms = _norms_reference(tensors)
    total = torch.linalg.vector_norm(norms)
    per = norms if per_tensor else torch.zeros(0, dtype=torch.float32, device=device)
    return total, per


def _l2norm_cuda(
    tensors: Sequence[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    tab = _mta.cached(_TAG, [tensors])
    if tab is not None and use_kernel(CAP, tab.data.device, tab.dtypes):
        return _l2norm_launch(tab, len(tensors), per_tensor)
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, REFERENCE_DTYPES)
    if not use_kernel(CAP, device, set(map(_dtype, tensors))):
        return _l2norm_reference(tensors, per_tensor)
    # A strided view (every other row, say) has a defined norm: walk a dense copy of it.
    ts = [t if t.is_contiguous() or is_dense(t) else t.contiguous() for t in tensors]
    with _cuda.on_device(device):
        return _l2norm_launch(_mta.table([ts], device, _TAG), len(ts), per_tensor)


def _l2norm_launch(tab: _mta.Table, n: int, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    per = torch.empty(n if per_tensor else 0, dtype=torch.float32, device=tab.data.device)
    return _launch(tab, n, per if per_tensor else None), per


def _launch(tab: _mta.Table, n: int, per: torch.Tensor | None) -> torch.Tensor:
    """One launch of ``mt_l2norm`` over ``tab`` (``n`` tensors); fills ``per`` unless None and
    returns the total. The outputs are separate allocations: the schema promises fresh tensors,
    and ``BoundNorm`` needs the total alone (one allocation a call)."""
    device = tab.data.device
    with _cuda.on_device(device):
        total = torch.empty((), dtype=torch.float32, device=device)
        scratch = tab.scratch(1 + 2 * n + (tab.num_chunks + 1) // 2)  # layout in the .cu
        _NORM(max(tab.num_chunks, 1), _BLOCK, tab.data, n, scratch, per, total)
    return total


def _l2norm_fake(
    tensors: list[torch.Tensor], per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_tensor_list("multi_tensor_l2norm", "tensors", tensors, REFERENCE_DTYPES)
    device = device if device is not None else torch.device("cpu")
    total = torch.empty((), dtype=torch.float32, device=device)
    per = torch.empty(len(tensors) if per_tensor else 0, dtype=torch.float32, device=device)
    return total, per


def _l2norm_setup(ctx, inputs, output) -> None:
    tensors, per_tensor = inputs
    total, per = output
    ctx.per_tensor = per_tensor
    ctx.save_for_backward(total, per, *tensors)


def _l2norm_backward(ctx, grad_total, grad_per):
    # d||x||/dx = x / ||x|| (0 where the norm is 0), for the global norm and each per-tensor one.
    total, per, *tensors = ctx.saved_tensors
    grads = []
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    for i, t in enumerate(tensors):
        coef = torch.where(total > 0, grad_total / safe_total, torch.zeros_like(total))
        if ctx.per_tensor and grad_per is not None:
            n = per[i]
            coef = coef + torch.where(n > 0, grad_per[i] / torch.where(n > 0, n, 1.0), 0.0)
        grads.append((t.float() * coef).to(t.dtype))
    return grads, None


L2NORM_OP = define(
    "multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)",
    _l2norm_reference,
    cuda=_l2norm_cuda,
    fake=_l2norm_fake,
    differentiable=True,
)
torch.library.register_autograd(
    "aiak::multi_tensor_l2norm", _l2norm_backward, setup_context=_l2norm_setup, lib=LIB
)


def multi_tensor_l2norm(
    tensors: Sequence[torch.Tensor], per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all ``tensors`` together (fp32, 0-dim) and, if ``per_tensor``, one per
    tensor (fp32, ``[len(tensors)]``; otherwise an empty tensor). Never synchronises the host.

    Accepts fp32/fp16/bf16 tensors (float64 too, on the reference), mixed, of any sizes (empty
    ones count 0) on one device.
    """
    return L2NORM_OP(list(tensors), per_tensor)


class BoundNorm:
    """The global L2 norm of an optimizer's gradients, step after step (LAMB's grad norm).

    The gradients of a fixed parameter list keep their sizes and dtypes (autograd and
    ``.grad`` assignment enforce the parameter's). So where their cache key (addresses, sizes,
    dtypes, contiguity: one C++ call, ``ops/_host.py``) is that of the last call, the device
    table kept from that call is launched at once, without the op's checks. Anything else runs
    :func:`multi_tensor_l2norm`. The caller makes a new one when its parameter list changes.

    The result is not differentiable: it is computed as under ``torch.no_grad()``, as
    ``torch.nn.utils.clip_grad_norm_`` computes its norm, so grad mode costs no pass over the
    gradients' ``requires_grad``. For a norm to backpropagate through, call the op.
    """

    __slots__ = ("_key", "_table")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._table: _mta.Table | None = None

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        tab = self._table
        if (
            tab is not None
            and L2NORM_OP.eager_kernel((grads, False), False) is L2NORM_OP.cuda
            and _mta.key(_TAG, [grads]) == self._key
            and use_kernel(CAP, tab.data.device, tab.dtypes)
        ):
            tab.wait()
            return _launch(tab, len(grads), None)
        with torch.no_grad():
            total, _ = multi_tensor_l2norm(grads)
        self._key = self._table = None
        if total.is_cuda:
            self._key = _mta.key(_TAG, [grads])
            self._table = None if self._key is None else _mta.lookup(self._key)
        return total
