"""amp's two bulk copies, each one multi-tensor call per device.

The scaled copy (``scale_``: copy + scale + non-finite check) is ``aiak::multi_tensor_scale_``,
called through its eager fast path (``aiak.ops.multi_tensor_scale``): one CUDA launch over every
tensor, the op's reference elsewhere; amp keeps no maths of its own. The plain copies
(``copy_``: grads in, masters back) are ``torch._foreach_copy_`` (backend ``"foreach"``), or the
op with a scale of 1 (backend ``"aiak"``). Nothing here synchronises the host.

Host cost is what matters here: every step copies 161 (ResNet-50) to ~170 (Swin-T) tensors
twice. :class:`Plan` does the per-tensor work (grouping, layout checks) once for a fixed list
of pairs, so a step costs a few C-level passes and one launch; :func:`scale_` / :func:`copy_`
are the one-shot forms.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from aiak.ops.multi_tensor_scale import SCALE_OP

__all__ = ["BACKENDS", "Plan", "copy_", "default_backend", "scale_", "unit_scalars"]

BACKENDS = ("aiak", "foreach")


def default_backend() -> str:
    """``"aiak"``: the op (always there: amp builds on aiak.ops)."""
    return "aiak"


def scale_(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    backend: str,
) -> None:
    """``dst[i] = src[i] * scale`` (cast to ``dst[i].dtype``); ``found_inf`` set to 1 on inf/NaN.

    ``scale`` and ``found_inf`` are one-element fp32 tensors on the tensors' device (for several
    devices: on the first one; copies are made per device without synchronising). Each pair has
    one shape and the same memory layout (contiguous, or channels_last on both). ``src[i]`` may
    be ``dst[i]``. Either backend runs the op: the fp32 product rounded once.
    """
    Plan(src, dst, backend).scale_(scale, found_inf)


def copy_(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], backend: str) -> None:
    """``dst[i] = src[i]`` cast to ``dst[i].dtype``, no non-finite check (the copy-back)."""
    Plan(src, dst, backend).copy_()


# device -> (a 1.0 scale, a scratch found_inf) for plain copies through the aiak op.
_UNIT: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def unit_scalars(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fp32 ``1.0`` scale and a scratch ``found_inf`` on ``device``, made once per device.

    Made per call they cost two allocations and two fill launches on every copy. Sharing the
    scratch flag is safe: the op only ever writes 1.0 into it and nobody reads it.
    """
    found = _UNIT.get(device)
    if found is None:
        found = _UNIT[device] = (
            torch.ones((), dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.float32, device=device),
        )
    return found


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers exactly ``numel`` consecutive elements in some dimension order."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous alias of dense ``t``'s memory (detached; shares its version counter)."""
    return t.detach().as_strided((t.numel(),), (1,))


class Plan:
    """Copies ``src[i] -> dst[i]`` (scaled, checked) for one fixed list of pairs, prepared once.

    Preparing walks the pairs in Python once: groups them by device (and by dtypes for the
    foreach kernels), and for the aiak op replaces each pair that is dense, non-contiguous and
    of one layout on both sides (channels_last conv weights and their grads) by 1-D aliases of
    the same memory. The op caches its validated device table only for contiguous sets and
    re-validates any other set tensor by tensor on every call (several µs per pair, 53 pairs in
    a channels_last ResNet-50); with the aliases it hits the cache. Elementwise over memory is
    the same elementwise operation when both sides share strides.

    A plan holds the tensors: it stays right while they keep their storage. :meth:`valid` says
    whether the aliased ones still do (``t.data = ...`` / ``set_`` would move them); tensors
    passed through as themselves need no check, the op reads their addresses on every call.
    """

    __slots__ = ("_alias_at", "_aliased", "_groups", "_ptrs", "backend")

    def __init__(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"scale_: backend must be one of {BACKENDS}, got {backend!r}")
        if len(src) != len(dst):
            raise ValueError(f"scale_: {len(src)} sources but {len(dst)} destinations")
        self.backend = backend
        src, dst = list(src), list(dst)
        aliased: list[torch.Tensor] = []  # (src, dst) pairs, flattened
        alias_at: list[int] = []
        if backend == "aiak" and not (
            all(map(_is_contiguous, src)) and all(map(_is_contiguous, dst))
        ):
            for i, (s, d) in enumerate(zip(src, dst)):
                if (
                    not (s.is_contiguous() and d.is_contiguous())
                    and s.shape == d.shape
                    and s.stride() == d.stride()
                    and _dense(s)
                ):
                    aliased += (s, d)
                    alias_at.append(i)
                    src[i], dst[i] = _flat(s), _flat(d)
        self._aliased = aliased
        self._alias_at = alias_at
        self._ptrs = list(map(_data_ptr, aliased))
        self._groups = _groups(src, dst, by_dtype=backend == "foreach")

    def with_src(self, src: Sequence[torch.Tensor]) -> Plan | None:
        """This plan for new sources that stand where the old ones stood: the same params'
        grads, made anew by a backward after ``zero_grad(set_to_none=True)``. Costs one list
        and one alias per aliased pair instead of a walk over every pair; None (prepare a new
        plan) unless the plan is one group and each aliased pair keeps its layout. A source
        of another dtype, device or layout elsewhere reaches the kernel as it is, which
        checks it (the op re-validates any set it has not seen; foreach accepts any)."""
        if len(self._groups) != 1:
            return None
        device, old_src, dst = self._groups[0]
        if len(src) != len(old_src):
            return None
        new_src = list(src)
        aliased = list(self._aliased)
        for k, i in enumerate(self._alias_at):
            s, d = new_src[i], aliased[2 * k + 1]
            if s.shape != d.shape or s.stride() != d.stride():
                return None
            aliased[2 * k] = s
            new_src[i] = _flat(s)
        plan = Plan.__new__(Plan)
        plan.backend = self.backend
        plan._aliased = aliased
        plan._alias_at = self._alias_at
        plan._ptrs = list(map(_data_ptr, aliased))
        plan._groups = [(device, new_src, dst)]
        return plan

    def valid(self) -> bool:
        """True while every aliased tensor still has the storage its alias was made from."""
        return not self._aliased or list(map(_data_ptr, self._aliased)) == self._ptrs

    def scale_(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """``dst[i] = src[i] * scale``; ``found_inf`` set to 1 on inf/NaN (see :func:`scale_`)."""
        for device, s_list, d_list in self._groups:
            dev_scale = scale if scale.device == device else scale.to(device, non_blocking=True)
            same = found_inf.device == device
            flag = found_inf if same else torch.zeros_like(found_inf, device=device)
            SCALE_OP(s_list, d_list, dev_scale, flag)
            if flag is not found_inf:
                found_inf.add_(flag.to(found_inf.device, non_blocking=True)).clamp_(max=1.0)

    def copy_(self) -> None:
        """``dst[i] = src[i]`` cast to ``dst[i].dtype``, no non-finite check."""
        for device, s_list, d_list in self._groups:
            if self.backend == "foreach":
                torch._foreach_copy_(d_list, s_list)
            else:
                one, scratch = unit_scalars(device)
                SCALE_OP(s_list, d_list, one, scratch)


def _groups(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], by_dtype: bool
) -> list[tuple[torch.device, list[torch.Tensor], list[torch.Tensor]]]:
    """Split pairs by device (and by dtypes: foreach kernels take their fast path only for one
    device and one dtype per list); the aiak op mixes dtypes in one launch."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
        lambda: ([], [])
    )
    for s, d in zip(src, dst):
        key = (s.device, s.dtype, d.dtype) if by_dtype else (s.device,)
        groups[key][0].append(s)
        groups[key][1].append(d)
    return [(key[0], s_list, d_list) for key, (s_list, d_list) in groups.items()]
