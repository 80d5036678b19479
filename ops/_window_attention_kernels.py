"""Window attention's CUDA kernels as declared to the launcher: entry points, parameters,
the ``mma`` kernels' compile-time variants, each kernel's dynamic shared memory, and the tensor
layouts the kernels read and write.

Grid sizing, launch plans and the launchers are in ``_window_attention_cuda``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from aiak.ops._driver import Kernel

__all__ = [
    "BWD_VARIANTS",
    "BWD_VARIANT_ENV",
    "DEFAULT_BWD_VARIANT",
    "DEFAULT_FWD_VARIANT",
    "FWD_VARIANTS",
    "FWD_VARIANT_ENV",
    "BwdVariant",
    "bwd_variant",
    "fwd_variant",
]

SOURCE = "window_attention.cu"
_CODE = {torch.float16: "f16", torch.bfloat16: "bf16"}
_STRIDES = "i64 qb, i64 qh, i64 qn, i64 kb, i64 kh, i64 kn, i64 vb, i64 vh, i64 vn, "
_SIZES = "i32 B_, i32 nH, i32 N, i32 nW, f32 scale"
# after q, k, v: the strides of out (forward), or of dout, then dq/dk/dv (backward); all in
# [B_, nH, N, D] order
_PARAMS = {
    "fwd": "ptr q, ptr k, ptr v, ptr bias, ptr mask, ptr out, "
    + _STRIDES
    + "i64 ob, i64 oh, i64 on, "
    + _SIZES,
    "bwd": "ptr dout, ptr q, ptr k, ptr v, ptr bias, ptr mask, ptr dq, ptr dk, ptr dv, "
    "ptr dbias, " + _STRIDES + "i64 gb, i64 gh, i64 gn, i64 xb, i64 xh, i64 xn, " + _SIZES,
}


@dataclasses.dataclass(frozen=True)
class BwdVariant:
    """One compile-time variant of the ``mma`` backward kernel (``WM_BACKWARD_V`` in the
    source): ``infix`` goes into its entry points' names, ``alias_ps``: P and dS share one
    shared-memory tile (the shared memory :func:`_mma_smem_bytes` sizes)."""

    infix: str
    alias_ps: bool
    about: str


# The mma backward's variants, selected by AIAK_WINDOW_ATTENTION_BWD (read once per process).
# A variant is one entry here and one WM_BACKWARD_V line per dtype and head dim in the source;
# deleting it is deleting both (and its row in docs/window_attention.md).
BWD_VARIANTS = {
    "base": BwdVariant("", False, "next window prefetched in registers; P, dS in two tiles"),
    "alias_ldm_cp": BwdVariant(
        "alias_ldm_cp_", True, "P, dS in one tile, ldmatrix fragments, tiles by cp.async early"
    ),
}
BWD_VARIANT_ENV = "AIAK_WINDOW_ATTENTION_BWD"
# fastest on the H100 at Swin-T's stages 1-3 (fwd+bwd 1.27x / 1.30x / 1.07x base's, stage 4
# equal; docs/window_attention.md), its gradients bit-identical to base's
DEFAULT_BWD_VARIANT = "alias_ldm_cp"


# The mma forward's variants (entry point infixes), selected by AIAK_WINDOW_ATTENTION_FWD (read
# once per process); one WM_FORWARD_V line per dtype and head dim each in the source.
FWD_VARIANTS = {
    "base": "",  # 32/16-bit fragment reads, 80 registers at D = 32 (six blocks per SM)
    "ldm": "ldm_",  # V's fragments by ldmatrix.trans, 96 registers at D = 32 (five blocks)
}
FWD_VARIANT_ENV = "AIAK_WINDOW_ATTENTION_FWD"
DEFAULT_FWD_VARIANT = "base"


def _choice(env: str, choices: dict, default: str) -> str:
    choice = os.environ.get(env, default)
    if choice not in choices:
        raise ValueError(f"{env} must be one of {tuple(choices)}, got {choice!r}")
    return choice


@functools.cache
def bwd_variant() -> str:
    """The ``mma`` backward variant of this process: ``AIAK_WINDOW_ATTENTION_BWD`` (one of
    :data:`BWD_VARIANTS`) or :data:`DEFAULT_BWD_VARIANT`; read on first use, then fixed."""
    return _choice(BWD_VARIANT_ENV, BWD_VARIANTS, DEFAULT_BWD_VARIANT)


@functools.cache
def fwd_variant() -> str:
    """The ``mma`` forward variant of this process: ``AIAK_WINDOW_ATTENTION_FWD`` (one of
    :data:`FWD_VARIANTS`) or :data:`DEFAULT_FWD_VARIANT`; read on first use, then fixed."""
    return _choice(FWD_VARIANT_ENV, FWD_VARIANTS, DEFAULT_FWD_VARIANT)


def _entry(kind: str, dtype: torch.dtype, d: int) -> str:
    """The source's entry point of ``kind``: "fwd", "bwd" (scalar), "mma_fwd_<variant>" or
    "mma_bwd_<variant>"."""
    if kind.startswith("mma_bwd_"):
        kind = "mma_bwd_" + BWD_VARIANTS[kind[8:]].infix
    elif kind.startswith("mma_fwd_"):
        kind = "mma_fwd_" + FWD_VARIANTS[kind[8:]]
    else:
        kind += "_"
    return f"window_attention_{kind}{_CODE[dtype]}_d{d}"


_KINDS = (
    "fwd",
    "bwd",
    *(f"mma_fwd_{v}" for v in FWD_VARIANTS),
    *(f"mma_bwd_{v}" for v in BWD_VARIANTS),
)
_KERNELS = {
    (kind, dtype, d): Kernel(
        SOURCE, _entry(kind, dtype, d), _PARAMS["bwd" if "bwd" in kind else "fwd"]
    )
    for kind in _KINDS
    for dtype in _CODE
    for d in (32, 64)
}

_THREADS = 128  # WA_THREADS in the source


def _smem_floats(n: int, d: int, backward: bool) -> int:
    np_ = (n + 3) & ~3
    ld, ls = d + 1, np_ + 1
    if backward:
        return 4 * np_ * ld + 2 * np_ * ls + n * n
    return 3 * np_ * ld + np_ * ls


def _mma_smem_bytes(d: int, backward: bool, alias_ps: bool = False) -> int:
    """Dynamic shared memory of the mma kernels (WM_* in the source): the fp32 [64][72]
    bias + mask table, [64][D + 8] q/k/v (and dout) tiles, and in backward [64][72] P and dS
    (one tile for both with ``alias_ps``)."""
    table = 64 * 72 * 4
    tiles = (4 if backward else 3) * 64 * (d + 8) * 2
    return table + tiles + ((1 if alias_ps else 2) * 64 * 72 * 2 if backward else 0)


def _mma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` when the mma kernels' 16-byte row loads are aligned (pointer and the strides of
    the first three dims, the last dim contiguous), else a contiguous copy."""
    ok = (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(t.stride(i) % 8 == 0 for i in range(3))
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _out_strides(q: torch.Tensor, tokens_first: bool) -> tuple[int, int, int]:
    """Strides of the forward's output in [B_, nH, N, D] order: contiguous, or with
    ``tokens_first`` those of a contiguous [B_, N, nH, D] seen through ``transpose(1, 2)``."""
    _, heads, n, d = q.shape
    return (n * heads * d, d, heads * d) if tokens_first else (heads * n * d, n * d, d)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fp32_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def _out_views(out: tuple, q: torch.Tensor) -> tuple | None:
    """The strides of ``out`` (dq, dk, dv views the kernels can write with 32-bit stores), or
    None for none given."""
    if not out:
        return None
    strides = out[0].stride()[:3]
    for name, t in zip(("dq", "dk", "dv"), out, strict=True):
        if (
            t.shape != q.shape
            or t.dtype != q.dtype
            or t.device != q.device
            or t.stride() != out[0].stride()
            or t.stride(-1) != 1
            or any(s % 2 for s in strides)
            or t.data_ptr() % 4
        ):
            raise ValueError(f"window_attention: out {name} is not a view the kernels can write")
    return strides
