"""What each op's CUDA kernel supports, as data; why a call falls back; input checks.

``Capability.not_supported_reasons`` feeds both the choice of implementation (kernel, or the
PyTorch reference with a one-time warning naming the reasons) and ``aiak.ops.backends()``:
the device's reasons (no CUDA, CuPy, compute capability, ``AIAK_DISABLE_KERNELS``), the
dtypes', and the shape and layout reasons of one call's inputs (``input_reasons``; stated for
``backends()`` as ``conditions``).
Input errors (wrong types, mismatched lists, mixed devices) are not fallbacks: they raise
``TypeError``/``ValueError`` naming the argument, the same on every device and path.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from aiak.ops import _cuda

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What the references take: the kernels' dtypes and float64 (computed in float64).
REFERENCE_DTYPES = (*FLOAT_DTYPES, torch.float64)


@dataclasses.dataclass(frozen=True)
class Capability:
    """What the CUDA kernel of op ``name`` handles; anything else runs the reference.

    ``input_reasons(*inputs)``: the shape and layout reasons one call's inputs cannot take the
    kernel (empty when they can); ``conditions``: the same rules in words, for ``backends()``.
    """

    name: str
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    backend: str = "cupy"
    min_compute_capability: tuple[int, int] = (7, 0)
    deterministic: bool = True
    input_reasons: Callable[..., list[str]] | None = None
    conditions: tuple[str, ...] = ()

    def not_supported_reasons(
        self,
        device: torch.device,
        dtypes: Iterable[torch.dtype] = (),
        inputs: tuple[Any, ...] | None = None,
    ) -> list[str]:
        """Why the kernel cannot run on ``device`` for ``dtypes`` (and, given, ``inputs``);
        empty when it can."""
        reasons = self._device_reasons(device, dtypes)
        if inputs is not None and self.input_reasons is not None:
            reasons += self.input_reasons(*inputs)
        return reasons

    def _device_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype]) -> list[str]:
        reasons: list[str] = []
        if device.type != "cuda":
            return [f"{self.name}: the kernel runs on cuda, not {device.type}"]
        for dt in sorted(set(dtypes) - set(self.dtypes), key=str):
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(
                f"{self.name}: dtype {str(dt).removeprefix('torch.')} not in ({allowed})"
            )
        if _cuda.kernels_disabled():
            reasons.append(f"{self.name}: AIAK_DISABLE_KERNELS=1")
            return reasons
        reason = _cuda.cupy_unavailable_reason()
        if reason is not None:
            reasons.append(f"{self.name}: {reason}")
        cc = _cuda.device_capability(device.index if device.index is not None else 0)
        if cc < self.min_compute_capability:
            need = ".".join(map(str, self.min_compute_capability))
            reasons.append(f"{self.name}: compute capability {cc[0]}.{cc[1]} < {need}")
        return reasons


CAPABILITIES: dict[str, Capability] = {}
_warned: set[tuple[str, tuple[str, ...]]] = set()
_warn_lock = threading.Lock()


def declare(cap: Capability) -> Capability:
    CAPABILITIES[cap.name] = cap
    return cap


def clear_warnings() -> None:
    """Forget which fallbacks have warned (tests)."""
    with _warn_lock:
        _warned.clear()


def use_kernel(
    cap: Capability,
    device: torch.device,
    dtypes: Iterable[torch.dtype],
    inputs: tuple[Any, ...] | None = None,
) -> bool:
    """True when the CUDA kernel can run; otherwise warn once (per reason set) and say False.

    A "yes" for (op, device, dtypes) is remembered (CuPy and the device do not change within a
    process); ``AIAK_DISABLE_KERNELS`` is read on every call, so it can be switched any time;
    ``inputs`` (given) are checked by ``cap.input_reasons`` on every call.
    """
    if type(dtypes) is not tuple and type(dtypes) is not frozenset:
        dtypes = frozenset(dtypes)
    key = (cap.name, device, dtypes)
    if key not in _usable or _cuda.kernels_disabled():
        reasons = cap.not_supported_reasons(device, dtypes)
        if reasons:
            return _fall_back(cap, reasons)
        _usable.add(key)
    if inputs is not None and cap.input_reasons is not None:
        reasons = cap.input_reasons(*inputs)
        if reasons:
            return _fall_back(cap, reasons)
    return True


def _fall_back(cap: Capability, reasons: list[str]) -> bool:
    key = (cap.name, tuple(reasons))
    with _warn_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        warnings.warn(
            "falling back to the PyTorch reference: " + "; ".join(reasons),
            RuntimeWarning,
            stacklevel=4,
        )
    return False


_usable: set[tuple] = set()


# --------------------------------------------------------------------------------------------
# Input checks, shared by the reference and the kernel so both reject the same inputs.
# --------------------------------------------------------------------------------------------


def check_tensor_list(
    op: str, arg: str, tensors: Sequence[torch.Tensor], dtypes: tuple[torch.dtype, ...]
) -> torch.device | None:
    """Check ``tensors`` is a list of strided tensors of ``dtypes`` on one device; its device.

    The common case (all fine) is one pass building a set; only a failure walks the list
    again to name the offending index. On the CUDA path this runs on every call: for 389
    tensors the explicit loop cost more host time than the kernel's GPU time.
    """
    if isinstance(tensors, (list, tuple)):
        try:
            kinds = {(t.device, t.dtype, t.layout) for t in tensors}
        except AttributeError:
            kinds = set()
        if len(kinds) == 1:
            ((device, dtype, layout),) = kinds
            if dtype in dtypes and layout == torch.strided:
                return device
        elif not tensors:
            return None
    return _explain_tensor_list(op, arg, tensors, dtypes)


def _explain_tensor_list(
    op: str, arg: str, tensors: Sequence[torch.Tensor], dtypes: tuple[torch.dtype, ...]
) -> torch.device | None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: {arg} must be a list of tensors, got {type(tensors).__name__}")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {arg}[{i}] must be a Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{op}: {arg}[{i}] has layout {t.layout}; only dense tensors")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(
                f"{op}: {arg}[{i}] has dtype {str(t.dtype).removeprefix('torch.')}; "
                f"supported: {allowed}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: {arg}[{i}] is on {t.device} but {arg}[0] is on {device}")
    return device


def check_scalar_tensor(
    op: str, arg: str, t: torch.Tensor, device: torch.device | None, dtype: torch.dtype
) -> None:
    """``t`` must be a one-element tensor of ``dtype`` on ``device`` (if known)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a Tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {arg} must have one element, has {t.numel()}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: {arg} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {arg} is on {t.device} but the tensors are on {device}")


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements in some dimension order
    (contiguous, channels_last, a transpose...), so a kernel may walk its memory linearly."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_hyper(op: str, **values: object) -> None:
    """Hyper-parameters: ``beta*`` in [0, 1), every other one a real number >= 0 (not NaN, not
    a string, not a tensor: the kernels take them by value)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
        if name.startswith("beta"):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")
        elif not 0.0 <= value < float("inf"):  # also rejects NaN
            raise ValueError(f"{op}: {name} must be >= 0 and finite, got {value}")


def same_layouts(lists: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Every non-empty tensor of every list laid out like list 0's (the kernels walk all lists'
    memory in one order). One C-level pass per list in the usual case."""
    first = tuple(map(torch.Tensor.stride, lists[0]))
    for ts in lists[1:]:
        if tuple(map(torch.Tensor.stride, ts)) != first and not all(
            t.numel() == 0 or same_layout(p, t) for p, t in zip(lists[0], ts)
        ):
            return False
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same memory order: strides agree wherever a dimension has size > 1."""
    if a.shape != b.shape:
        return False
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _layouts(ts: Sequence[torch.Tensor]) -> tuple:
    # map over unbound methods: the cheapest per-tensor calls from Python.
    return tuple(map(_shape, ts)), tuple(map(torch.Tensor.stride, ts)), tuple(map(_dtype, ts))


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def check_aligned_lists(
    op: str,
    params: Sequence[torch.Tensor],
    same: dict[str, Sequence[torch.Tensor]],
    copy_to: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor] | None,
    scalars: dict[str, torch.Tensor | None],
    dtypes: tuple[torch.dtype, ...] = REFERENCE_DTYPES,
) -> torch.device | None:
    """Lists aligned with ``params``: ``same`` ones have each param's shape and dtype
    (``updates``: fp32; strides may differ: the kernels take matching layouts, the references
    any); ``copy_to`` is empty or one tensor per param (an empty one meaning
    "none"); ``state_steps`` one-element fp32 tensors; ``scalars`` one-element fp32 tensors or
    None. All on one device, which is returned (None for no params)."""
    device = check_tensor_list(op, "params", params, dtypes)
    n = len(params)
    shapes, _, pdtypes = _layouts(params)
    for name, ts in same.items():
        d = check_tensor_list(op, name, ts, dtypes)
        if len(ts) != n:
            raise ValueError(f"{op}: {name} has {len(ts)} tensors but params has {n}")
        if n and d != device:
            raise ValueError(f"{op}: {name} is on {d} but params are on {device}")
        want = (torch.float32,) * n if name == "updates" else pdtypes
        if (tuple(map(_shape, ts)), tuple(map(_dtype, ts))) != (shapes, want):
            _explain_mismatch(op, name, params, ts)
    if copy_to:
        d = check_tensor_list(op, "copy_to", copy_to, dtypes)
        if len(copy_to) != n:
            raise ValueError(f"{op}: copy_to has {len(copy_to)} tensors but params has {n}")
        if d != device:
            raise ValueError(f"{op}: copy_to is on {d} but params are on {device}")
        for i, (p, t) in enumerate(zip(params, copy_to)):
            if t.numel() and t.shape != p.shape:
                raise ValueError(f"{op}: copy_to[{i}] must be empty or match params[{i}] in shape")
    if state_steps is not None:
        if not isinstance(state_steps, (list, tuple)) or len(state_steps) != n:
            got = len(state_steps) if isinstance(state_steps, (list, tuple)) else "no"
            raise ValueError(f"{op}: state_steps has {got} tensors but params has {n}")
        d = check_tensor_list(op, "state_steps", state_steps, (torch.float32,))
        if n and (d != device or set(map(torch.Tensor.numel, state_steps)) != {1}):
            for i, s in enumerate(state_steps):
                check_scalar_tensor(op, f"state_steps[{i}]", s, device, torch.float32)
    for name, t in scalars.items():
        if t is not None:
            check_scalar_tensor(op, name, t, device, torch.float32)
    return device


def _explain_mismatch(
    op: str, name: str, params: Sequence[torch.Tensor], ts: Sequence[torch.Tensor]
) -> None:
    """Raise naming the first tensor of ``ts`` unlike its param."""
    for i, (p, t) in enumerate(zip(params, ts)):
        if t.shape != p.shape:
            raise ValueError(
                f"{op}: {name}[{i}] (shape {tuple(t.shape)}) must match params[{i}] "
                f"(shape {tuple(p.shape)})"
            )
        want = torch.float32 if name == "updates" else p.dtype
        if t.dtype != want:
            raise TypeError(f"{op}: {name}[{i}] is {t.dtype}, must be {want}")
