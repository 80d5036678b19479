"""amp's two bulk copies, each one multi-tensor launch per (device, dtypes) group.

``aiak::multi_tensor_scale_`` when ``aiak.ops`` is importable (one CUDA launch over every
tensor, copy + scale + non-finite check in one pass), else ``torch._foreach_*``. Nothing here
synchronises the host.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence

import torch

# The one sibling amp may touch, and only through torch.ops (ARCHITECTURE.md rule 1).
with contextlib.suppress(ImportError):
    import aiak.ops  # noqa: F401  (registers torch.ops.aiak.*)

__all__ = ["BACKENDS", "copy_", "default_backend", "scale_"]

BACKENDS = ("aiak", "foreach")


def default_backend() -> str:
    """``"aiak"`` when ``torch.ops.aiak.multi_tensor_scale_`` is registered, else ``"foreach"``."""
    return "aiak" if hasattr(torch.ops.aiak, "multi_tensor_scale_") else "foreach"


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
    be ``dst[i]``. Both backends give the same bits: the fp32 product rounded once.
    """
    if backend not in BACKENDS:
        raise ValueError(f"scale_: backend must be one of {BACKENDS}, got {backend!r}")
    if len(src) != len(dst):
        raise ValueError(f"scale_: {len(src)} sources but {len(dst)} destinations")
    for device, s_list, d_list in _groups(src, dst, by_dtype=backend == "foreach"):
        dev_scale = scale if scale.device == device else scale.to(device, non_blocking=True)
        same = found_inf.device == device
        flag = found_inf if same else torch.zeros_like(found_inf, device=device)
        if backend == "aiak":
            torch.ops.aiak.multi_tensor_scale_(s_list, d_list, dev_scale, flag)
        elif d_list[0].dtype in (torch.float32, s_list[0].dtype):
            # dst holds every src value exactly: copy, then the kernel GradScaler.unscale_ uses
            # (checks the values, multiplies in fp32, rounds once), as the op does.
            if any(s is not d for s, d in zip(s_list, d_list)):
                torch._foreach_copy_(d_list, s_list)
            torch._amp_foreach_non_finite_check_and_unscale_(d_list, flag, dev_scale)
        else:
            # A narrowing cast: scale in fp32 first so the product is rounded once, as the op
            # does. amp itself never scales into a narrower dtype (its copy-back is copy_).
            tmp = [s.to(torch.float32, copy=True) for s in s_list]  # never scale src itself
            torch._amp_foreach_non_finite_check_and_unscale_(tmp, flag, dev_scale)
            torch._foreach_copy_(d_list, tmp)
        if flag is not found_inf:
            found_inf.add_(flag.to(found_inf.device, non_blocking=True)).clamp_(max=1.0)


def copy_(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], backend: str) -> None:
    """``dst[i] = src[i]`` cast to ``dst[i].dtype``, no non-finite check (the copy-back)."""
    if not src:
        return
    if backend == "foreach":
        for _, s_list, d_list in _groups(src, dst, by_dtype=True):
            torch._foreach_copy_(d_list, s_list)
        return
    device = src[0].device
    one = torch.ones((), dtype=torch.float32, device=device)
    scale_(src, dst, one, torch.zeros((), dtype=torch.float32, device=device), backend)


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
