"""Host (CPU) cost per call of the multi-tensor ops, split by stage, and a cProfile of one op.

    python research/profile_host.py

Not a speed claim: a diagnosis of where Python time goes when the GPU waits for the host.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

import aiak.ops
from aiak.conformance.shapes import BERT_LARGE, RESNET50
from aiak.ops import _capability, _cuda, _mta
from aiak.ops import multi_tensor_l2norm as l2
from aiak.ops import multi_tensor_scale as sc


def host_us(fn: Callable[[], Any], calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def _no_grad(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.no_grad():
        return fn(*args)


def profile_set(name: str, shapes: list[tuple[int, ...]]) -> None:
    ts = [torch.randn(s, device="cuda") for s in shapes]
    dst = [torch.empty_like(t) for t in ts]
    s, found = torch.tensor(1.0, device="cuda"), torch.zeros(1, device="cuda")
    fp32 = (torch.float32, torch.float16, torch.bfloat16)
    stages = {
        "torch.ops.aiak.multi_tensor_l2norm": lambda: torch.ops.aiak.multi_tensor_l2norm(ts, True),
        "  Op eager fast path (no_grad)": lambda: _no_grad(l2.L2NORM_OP, ts, True),
        "  launcher without dispatcher": lambda: l2._l2norm_cuda(ts, True),
        "  check_tensor_list": lambda: _capability.check_tensor_list("x", "t", ts, fp32),
        "  _mta.table (hit)": lambda: _mta.table([ts], ts[0].device),
        "  use_kernel": lambda: _capability.use_kernel(l2.CAP, ts[0].device, {torch.float32}),
        "  is_contiguous pass": lambda: all(map(torch.Tensor.is_contiguous, ts)),
        "  get_function + raw_stream": lambda: (
            _cuda.get_function("multi_tensor_l2norm.cu", "mt_l2norm"),
            _cuda.raw_stream(0),
        ),
        "torch._foreach_norm + stack": lambda: torch.stack(torch._foreach_norm(ts)),
        "torch.ops.aiak.multi_tensor_scale_": lambda: torch.ops.aiak.multi_tensor_scale_(
            ts, dst, s, found
        ),
        "  Op eager fast path": lambda: sc.SCALE_OP(ts, dst, s, found),
        "  launcher without dispatcher ": lambda: sc._scale_cuda(ts, dst, s, found),
        "  _check_scale_args": lambda: sc._check_scale_args(ts, dst, s, found),
        "torch._foreach_mul": lambda: torch._foreach_mul(ts, s),
    }
    print(f"== {name}: {len(ts)} tensors, host µs per call")
    for label, fn in stages.items():
        print(f"{label:40s} {host_us(fn):8.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        torch.ops.aiak.multi_tensor_scale_(ts, dst, s, found)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print("\n".join(out.getvalue().splitlines()[:30]))


def main() -> None:
    for name, shapes in (("bert", BERT_LARGE), ("resnet", RESNET50)):
        profile_set(name, shapes)
    print(aiak.ops.backends()["ops"])


if __name__ == "__main__":
    main()
