"""``aiak::batch_norm_act``'s CUDA side: the kernels' declarations, launch plans, the ticket
buffers of the last-block reductions, and the two launchers (``kernels/batch_norm_act.cu``).

Host time decides this op's design as much as the kernels: a ResNet-50 step calls it 49 times
each way, and the step is host-bound on the lent machines' hosts (the forward's Python, at
b128, took 10.4 ms of a 28 ms step before the op). So a call looks up one cached
:class:`Plan` (kernels, grids, workspace layout) by its inputs' shapes, strides, dtypes and
alignment, makes one fp32 workspace allocation per direction (statistics and partial sums
side by side, passed to the kernels as addresses), and launches two kernels.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from aiak.ops import _cuda
from aiak.ops._driver import Kernel

_SOURCE = "batch_norm_act.cu"
_THREADS = 256  # __launch_bounds__ in the source
_CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
WCODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # load_w / store_w
_VEC = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}  # 16-byte accesses


def _kernels(suffix: str) -> dict[str, Kernel]:
    params = {
        "stats": "ptr x, ptr partial, ptr tickets, ptr mean, ptr invstd, ptr running_mean, "
        "ptr running_var, i32 rcode, f32 momentum, f32 eps, i64 M, i32 C, i32 gx",
        "apply": "ptr x, ptr res, ptr y, ptr mean, ptr invstd, ptr weight, ptr bias, i32 wcode, "
        "i32 relu, i64 M, i32 C, i32 gx",
        "grad_reduce": "ptr dy, ptr y, ptr x, ptr gout, ptr mean, ptr invstd, ptr partial, "
        "ptr tickets, "
        "ptr sums, ptr dweight, ptr dbias, i32 wcode, i32 relu, i64 M, i32 C, i32 gx",
        "grad_input": "ptr dy, ptr y, ptr x, ptr dx, ptr dres, ptr mean, ptr invstd, "
        "ptr weight, i32 wcode, ptr sums, i32 relu, i64 M, i32 C, i32 gx",
    }
    return {k: Kernel(_SOURCE, f"bn_{k}_{suffix}", p) for k, p in params.items()}


_KERNELS = {(dt, v): _kernels(f"{code}_v{v}") for dt, code in _CODE.items() for v in (_VEC[dt], 1)}

# Grids: a reduction runs _REDUCE_PER_SM blocks per SM (its partial rows stay few, so the last
# block's combine is short); a pass _PASS_PER_SM (occupancy for plain streaming). Each block is
# `gx` channel vectors by 256 / gx rows; 8 vectors keep a warp's loads on whole 128-byte lines
# and a slice's channels (8 vectors) few enough that the combine splits each over 4 threads.
_REDUCE_PER_SM = 2
_PASS_PER_SM = 8
_GX = 8


class Plan(NamedTuple):
    """What a call needs besides its tensors: the kernels, grids, sizes, workspace layout."""

    stats: Kernel
    apply: Kernel
    grad_reduce: Kernel
    grad_input: Kernel
    m: int
    c: int
    gx: int
    reduce_grid: tuple[int, int]
    pass_grid: tuple[int, int]
    floats: int  # workspace: [2C statistics or sums][partials: reduce_grid[0] x 2 x C]


def _plan(m: int, c: int, dtype: torch.dtype, v: int, dev: int) -> Plan:
    groups = c // v
    gx = min(groups, _GX)
    rows = _THREADS // gx
    slices = -(-groups // gx)
    sms = _cuda.num_sms(dev)

    def grid(per_sm: int) -> tuple[int, int]:
        return (max(1, min(-(-m // rows), -(-per_sm * sms // slices))), slices)

    k = _KERNELS[dtype, v]
    rgrid = grid(_REDUCE_PER_SM)
    floats = 2 * c + rgrid[0] * 2 * c
    return Plan(k["stats"], k["apply"], k["grad_reduce"], k["grad_input"], m, c, gx, rgrid,
                grid(_PASS_PER_SM), floats)  # fmt: skip


# (shape, dtype, device, 16-byte-aligned) -> Plan; the input's channels are innermost
_plans: dict[tuple, Plan] = {}


def plan_for(x: torch.Tensor, aligned: bool) -> Plan:
    """The plan of channels-innermost CUDA ``x`` (``aligned``: every pointer of the call is
    16-byte aligned, so whole vectors move at once)."""
    key = (x.shape, x.dtype, x.get_device(), aligned)
    plan = _plans.get(key)
    if plan is None:
        c = x.shape[1]
        v = _VEC[x.dtype] if aligned and c % _VEC[x.dtype] == 0 else 1
        plan = _plans[key] = _plan(x.numel() // c, c, x.dtype, v, x.get_device())
    return plan


def aligned(*tensors: torch.Tensor | None) -> bool:
    ptrs = 0
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
    return ptrs & 15 == 0


def like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` with ``x``'s (channels-innermost) memory layout: itself when it has it."""
    if t.stride() == x.stride():
        return t
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


# Tickets of the last-block pattern (u64 per slice), per (device, stream): the last block
# resets its ticket, so one zeroed buffer serves every later launch on its stream. A call
# captured into a CUDA graph gets its own, the zeroing captured with it.
_tickets: dict[tuple[int, int], torch.Tensor] = {}
_tickets_lock = threading.Lock()


def _ticket_buffer(x: torch.Tensor, slices: int) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(slices, dtype=torch.int64, device=x.device)
    dev = x.get_device()
    key = (dev, _cuda.raw_stream(dev))
    buf = _tickets.get(key)
    if buf is None or buf.numel() < slices:
        with _tickets_lock:
            buf = _tickets.get(key)
            if buf is None or buf.numel() < slices:
                buf = _tickets[key] = torch.zeros(
                    max(slices, 64), dtype=torch.int64, device=x.device
                )
    return buf


def launch_forward(
    plan: Plan,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    relu: bool,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    momentum: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, workspace)`` of checked, kernel-ready CUDA input in ``x``'s layout (``residual``
    too); the batch's mean is ``workspace[:C]``, its invstd ``workspace[C:2C]``."""
    c, m, gx = plan.c, plan.m, plan.gx
    y = torch.empty_like(x)
    ws = torch.empty(plan.floats, dtype=torch.float32, device=x.device)
    mean = ws.data_ptr()
    invstd = mean + 4 * c
    w = weight if weight is not None else bias
    wcode = WCODE[w.dtype] if w is not None else 0
    rcode = WCODE[running_mean.dtype] if running_mean is not None else 0
    with _cuda.on_device(x.device):
        tickets = _ticket_buffer(x, plan.reduce_grid[1])
        plan.stats(
            plan.reduce_grid, _THREADS, x, invstd + 4 * c, tickets, mean, invstd, running_mean,
            running_var, rcode, momentum, eps, m, c, gx,
        )  # fmt: skip
        plan.apply(
            plan.pass_grid, _THREADS, x, residual, y, mean, invstd, weight, bias, wcode,
            int(relu), m, c, gx,
        )  # fmt: skip
    return y, ws


def launch_backward(
    plan: Plan,
    grad: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias_dtype: torch.dtype | None,
    mean: int,
    invstd: int,
    relu: bool,
    residual: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias, dresidual)`` (None where absent: no weight, ``bias_dtype`` None,
    no residual); ``mean`` and ``invstd`` are the addresses of the forward's fp32 statistics;
    ``grad`` in ``x``'s layout."""
    c, m, gx = plan.c, plan.m, plan.gx
    dx = torch.empty_like(x)
    dres = torch.empty_like(x) if residual else None
    wdtype = weight.dtype if weight is not None else bias_dtype
    wcode = WCODE[wdtype] if wdtype is not None else 0
    # [sums 2C][dweight C][dbias C][partials]: fp32 weights' gradients share the allocation
    ws = torch.empty(plan.floats + 2 * c, dtype=torch.float32, device=x.device)
    sums = ws.data_ptr()
    if wcode == 0:
        dw, db = ws[2 * c : 3 * c], ws[3 * c : 4 * c]
    elif wdtype is not None:
        dwb = torch.empty((2, c), dtype=wdtype, device=x.device)
        dw, db = dwb[0], dwb[1]
    dweight = dw if weight is not None else None
    dbias = db if bias_dtype is not None else None
    r = int(relu)
    with _cuda.on_device(x.device):
        tickets = _ticket_buffer(x, plan.reduce_grid[1])
        plan.grad_reduce(
            plan.reduce_grid, _THREADS, grad, y, x, dres, mean, invstd, sums + 16 * c, tickets,
            sums, dweight, dbias, wcode, r, m, c, gx,
        )  # fmt: skip
        if dres is not None:  # the masked gradient is written: read it instead of grad and y
            grad, r = dres, 0
        plan.grad_input(
            plan.pass_grid, _THREADS, grad, y, x, dx, None, mean, invstd, weight, wcode, sums,
            r, m, c, gx,
        )  # fmt: skip
    return dx, dweight, dbias, dres
