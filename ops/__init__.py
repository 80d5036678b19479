"""aiak.ops — the custom-op registry: ``torch.ops.aiak.*``.

Each op is declared once (``ops/_registry.py``: ``torch.library.define`` + ``impl``, which costs a
quarter of ``custom_op``'s per-call host time); its default kernel is a plain-PyTorch
reference that runs anywhere (CPU included) and is the ground truth of the conformance suite;
a CUDA kernel (CUDA C++ compiled at run time by CuPy/NVRTC) is registered for ``cuda``; fake
(meta) implementations make the ops traceable by ``torch.compile``. When a kernel cannot run
(no CuPy, an unsupported dtype, ``AIAK_DISABLE_KERNELS=1``) the op warns once and runs the
reference; :func:`backends` says which path each op takes here and why.

Importing this package neither initialises CUDA nor imports cupy, numba or numpy.
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.ops import _cuda
from aiak.ops._capability import CAPABILITIES, Capability
from aiak.ops._fused import Bound, bind
from aiak.ops.cast_scale import cast_scale_
from aiak.ops.fused_adam import fused_adam_
from aiak.ops.fused_lamb import fused_lamb_
from aiak.ops.fused_sgd import fused_sgd_
from aiak.ops.multi_tensor_l2norm import multi_tensor_l2norm
from aiak.ops.multi_tensor_scale import multi_tensor_scale_

__all__ = [
    "CAPABILITIES",
    "Bound",
    "Capability",
    "backends",
    "bind",
    "cast_scale_",
    "fused_adam_",
    "fused_lamb_",
    "fused_sgd_",
    "multi_tensor_l2norm",
    "multi_tensor_scale_",
]


def backends() -> dict[str, Any]:
    """What can run here and why not: torch, CUDA devices, CuPy, numba-cuda, and per op the
    path a CUDA call takes (``"cupy"`` or ``"reference: <reasons>"``).

    Unlike ``import aiak.ops`` this initialises CUDA and imports cupy when they are present.
    """
    info: dict[str, Any] = {"torch": torch.__version__}
    cuda_ok = torch.cuda.is_available()
    info["cuda"] = {
        "available": cuda_ok,
        "reason": None if cuda_ok else "torch.cuda.is_available() is False",
        "version": torch.version.cuda,
        "devices": [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            }
            for i in range(torch.cuda.device_count())
        ]
        if cuda_ok
        else [],
    }
    reason = _cuda.cupy_unavailable_reason()
    info["cupy"] = {"available": reason is None, "reason": reason, "version": None}
    if reason is None:
        info["cupy"]["version"] = _cuda.cupy().__version__
    reason = _cuda.numba_unavailable_reason()
    info["numba_cuda"] = {"available": reason is None, "reason": reason}
    ops: dict[str, str] = {}
    for name, cap in sorted(CAPABILITIES.items()):
        if not cuda_ok:
            ops[name] = "reference: no CUDA device"
            continue
        reasons = cap.not_supported_reasons(torch.device("cuda", torch.cuda.current_device()))
        ops[name] = cap.backend if not reasons else "reference: " + "; ".join(reasons)
    info["ops"] = ops
    return info
