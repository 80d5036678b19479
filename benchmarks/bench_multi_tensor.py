"""aiak::multi_tensor_l2norm and aiak::multi_tensor_scale_ vs torch's foreach ops.

    python benchmarks/bench_multi_tensor.py [--sets bert,resnet] [--dtypes float32,float16]

Parameter sets (aiak.conformance.shapes): BERT-large (334M parameters in 389 tensors) and
ResNet-50 (25.6M in 161). Bytes moved are counted as the op's floor: the norm reads every
element once; scale reads src and writes dst once. "% copy" is achieved bytes/s over the
device-to-device copy bandwidth measured in the same run (read + write).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from _harness import (
    append_csv,
    copy_bandwidth,
    print_table,
    time_eager,
    time_graph,
    time_pipelined,
)

import aiak.ops  # noqa: F401 - registers torch.ops.aiak.*
from aiak.conformance.shapes import BERT_LARGE, RESNET50

SETS = {"bert": BERT_LARGE, "resnet": RESNET50}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tensors(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(s, device="cuda").to(dtype) for s in shapes]


def _cases(shapes: list[tuple[int, ...]], dtype: torch.dtype):
    """(op label, bytes moved, ours, torch) for one parameter set and dtype."""
    src = _tensors(shapes, dtype)
    n = sum(t.numel() for t in src)
    size = src[0].element_size()
    s = torch.tensor(0.5, device="cuda")
    one = torch.tensor(1.0, device="cuda")  # in place: repeated calls must not decay to zeros
    found = torch.zeros(1, device="cuda")

    def torch_norm() -> None:
        norms = torch._foreach_norm(src)
        torch.linalg.vector_norm(torch.stack(norms))

    yield (
        "l2norm per-tensor",
        n * size,
        lambda: torch.ops.aiak.multi_tensor_l2norm(src, True),
        torch_norm,
    )

    dst = [torch.empty_like(t) for t in src]
    yield (
        "scale out-of-place",
        2 * n * size,
        lambda: torch.ops.aiak.multi_tensor_scale_(src, dst, s, found),
        lambda: torch._foreach_mul(src, s),
    )
    if dtype in (torch.float32, torch.float16):
        # amp's in-place unscale with an inf check: torch's own fused op for exactly that.
        yield (
            "scale in-place + inf check",
            2 * n * size,
            lambda: torch.ops.aiak.multi_tensor_scale_(src, src, one, found),
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(src, found, one),
        )
    if dtype == torch.float16:
        # O2: fp16 model grads -> fp32 master grads, unscaled, in one pass.
        master = [torch.empty_like(t, dtype=torch.float32) for t in src]

        def torch_two_pass() -> None:
            torch._foreach_copy_(master, src)
            torch._amp_foreach_non_finite_check_and_unscale_(master, found, s)

        yield (
            "scale fp16->fp32 (amp)",
            6 * n,
            lambda: torch.ops.aiak.multi_tensor_scale_(src, master, s, found),
            torch_two_pass,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="bert,resnet")
    p.add_argument("--dtypes", default="float32,float16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_multi_tensor: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (r+w)")
    rows = []
    for set_name in args.sets.split(","):
        shapes = SETS[set_name]
        for dtype_name in args.dtypes.split(","):
            for op, nbytes, ours, base in _cases(shapes, DTYPES[dtype_name]):
                row = {
                    "set": f"{set_name}[{len(shapes)}]",
                    "dtype": dtype_name,
                    "op": op,
                    "params_M": sum(math.prod(s) for s in shapes) / 1e6,
                    "bytes": nbytes,
                }
                for who, fn in (("ours", ours), ("torch", base)):
                    row[f"{who}_eager_ms"] = time_eager(fn)[1]
                    p20, p50, p80 = time_pipelined(fn)
                    row[f"{who}_ms"], row[f"{who}_p20"], row[f"{who}_p80"] = p50, p20, p80
                    g = time_graph(fn)
                    row[f"{who}_graph_ms"] = g[1] if g else float("nan")
                # The figure: back-to-back calls (host and GPU overlap, as in training).
                row["speedup"] = row["torch_ms"] / row["ours_ms"]
                for who in ("ours", "torch"):
                    gpu = row[f"{who}_graph_ms"]
                    gpu = gpu if gpu == gpu else row[f"{who}_ms"]  # NaN: not capturable
                    row[f"{who}_%copy"] = 100 * nbytes / (gpu * 1e-3) / 1e9 / copy_gbs
                row["copy_GBs"] = copy_gbs
                rows.append(row)
                torch.cuda.empty_cache()
    path = append_csv("multi_tensor", rows)
    print(
        "ms per call: eager = a lone call; ms = back to back (the figure); graph = GPU only."
        " %copy = op floor bytes / GPU time / copy bandwidth"
    )
    print_table(
        rows,
        [
            "set",
            "dtype",
            "op",
            "ours_eager_ms",
            "ours_ms",
            "ours_graph_ms",
            "torch_eager_ms",
            "torch_ms",
            "torch_graph_ms",
            "speedup",
            "ours_%copy",
            "torch_%copy",
        ],
    )
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
