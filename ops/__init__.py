"""aiak.ops — the custom-op registry: ``torch.ops.aiak.*``, the foundation of aiak.

One op, one name, four places: ``ops/<op>.py`` (schema, checks, the PyTorch reference, the CUDA
launcher with its declared kernels, the declaration), ``ops/kernels/<op>.cu``,
``tests/ops/test_<op>.py``, ``benchmarks/bench_<op>.py``. Shared pieces, one module each:
``_registry`` (declaring an op, its eager fast path, ``Op.bind``), ``_capability`` (what a
kernel supports, why a call falls back, input checks), ``_cuda`` (compilation, streams, the
device), ``_driver`` (``Kernel``: every launch, its parameter types declared and checked against
the source), ``_mta`` (multi-tensor device tables and their cache), ``_host`` (the cache key's
per-tensor reads in one C++ call, with a Python fallback), ``_fused`` (what the fused optimizer
ops share, and their bound steps).

Each op has one math in two implementations: its reference (plain PyTorch; the CPU, float64
and no-CuPy path, and the conformance ground truth) and its CUDA kernel. When a kernel cannot
run (no CuPy, an unsupported dtype, shape or layout, ``AIAK_DISABLE_KERNELS=1``) the op warns
once naming the reason and runs the reference; :func:`backends` says which path each op takes
here and what a call's inputs must meet. Importing this package neither initialises CUDA nor
imports cupy or numpy.

One optimizer step, from ``FusedAdamW.step`` to the launch, is five frames
(docs/architecture.md draws it): ``FusedOptimizer.step`` -> ``FusedAdam._step_group`` ->
``_fused.Bound.__call__`` (the kept device table, when the grads' and params' layout key is
the last step's) -> ``fused_adam._launch`` -> ``_driver.Kernel.__call__``
(``cuLaunchKernelEx``).
"""

from __future__ import annotations

from typing import Any

import torch

from aiak.ops import _capability, _cuda, _host
from aiak.ops import batch_norm_act as _batch_norm_act  # noqa: F401 (registers the op)
from aiak.ops import dgc_segments as _dgc_segments  # noqa: F401 (registers the op)
from aiak.ops import dgc_select as _dgc_select  # noqa: F401 (registers aiak::dgc_select)
from aiak.ops.cast_scale import cast_scale_
from aiak.ops.fcos3d import fcos3d_targets
from aiak.ops.fused_adam import fused_adam_
from aiak.ops.fused_lamb import fused_lamb_
from aiak.ops.fused_sgd import fused_sgd_
from aiak.ops.multi_tensor_l2norm import multi_tensor_l2norm
from aiak.ops.multi_tensor_scale import multi_tensor_scale_
from aiak.ops.simota import simota_assign
from aiak.ops.window_attention import roll_window_partition, window_merge_roll

__all__ = [
    "backends",
    "cast_scale_",
    "fcos3d_targets",
    "fused_adam_",
    "fused_lamb_",
    "fused_sgd_",
    "multi_tensor_l2norm",
    "multi_tensor_scale_",
    "roll_window_partition",
    "simota_assign",
    "window_merge_roll",
]


def backends() -> dict[str, Any]:
    """What can run here and why not: torch, CUDA devices, CuPy, per op the path a CUDA call
    takes (``"cupy"`` or ``"reference: <reasons>"``), and per op the shape and layout
    ``conditions`` a call's inputs must meet for the kernel.

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
    # the host helper is built only where a CUDA call would build it
    info["host_path"] = _host.status() if cuda_ok else "python: no CUDA device"
    ops: dict[str, str] = {}
    for name, cap in sorted(_capability.CAPABILITIES.items()):
        if not cuda_ok:
            ops[name] = "reference: no CUDA device"
            continue
        reasons = cap.not_supported_reasons(torch.device("cuda", torch.cuda.current_device()))
        ops[name] = cap.backend if not reasons else "reference: " + "; ".join(reasons)
    info["ops"] = ops
    # per op, what a call's inputs must meet for the kernel; a call that does not runs the
    # reference, and its one-time warning names the reason
    info["conditions"] = {
        name: list(cap.conditions)
        for name, cap in sorted(_capability.CAPABILITIES.items())
        if cap.conditions
    }
    return info
