"""aiak::cast_scale_ vs the torch ops aiak.comm's fp16/bf16 compression used before it.

    python benchmarks/bench_cast_scale.py [--sizes 16777216,6553600,1048576]

Encode: fp32 bucket -> fp16/bf16 wire, times ``scale`` (torch: ``torch.mul(g, scale, out=w)``).
Decode: wire -> fp32 bucket, times ``1/scale`` computed in fp32 (torch: ``torch.mul(w,
factor_fp32_tensor, out=g)``, the broadcasting TensorIterator path). 16M elements is one
Linear(4096, 4096) weight (a 64 MB DDP bucket). "% copy" = bytes read + written / GPU time
over the device-to-device copy bandwidth of the same run; "host_us" = host time per call.

``--hooks`` adds the GPU work each fp16 DDP hook puts on one bucket besides the allreduce,
DDP's copy of the result into the gradients included, against no hook (that copy alone):
torch's ``fp16_compress_hook`` (cast, ``div_`` by the world size, cast back), aiak's
``fp16_compress()`` (cast; DDP's copy reads the fp16 wire) and ``fp16_compress(scale=10)``
(the two torch ``mul`` calls its encode and decode are). Times 12 buckets, this is the GPU part
of the overhead bench_comm_nccl.py measures on the 12 x Linear(4096) step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _harness import append_csv, copy_bandwidth, print_table, time_graph, time_pipelined

from aiak.ops import cast_scale_

SCALE = 10.0


def _host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def _cases(n: int, wire_dtype: torch.dtype):
    g = torch.randn(n, device="cuda") * 1e-3
    w = torch.empty(n, dtype=wire_dtype, device="cuda")
    back = torch.empty(n, device="cuda")
    factor = torch.full((1,), 1.0 / SCALE, device="cuda")
    nbytes = n * (4 + w.element_size())
    yield (
        "encode",
        nbytes,
        lambda: cast_scale_(w, g, SCALE),
        lambda: torch.mul(g, SCALE, out=w),
    )
    cast_scale_(w, g, SCALE)
    yield (
        "decode",
        nbytes,
        lambda: cast_scale_(back, w, 1.0 / SCALE),
        lambda: torch.mul(w, factor, out=back),
    )


def _hook_pipelines(n: int, world: int = 2):
    """(name, fn): each hook's GPU work on one bucket of ``n`` fp32 elements, allreduce left out
    (what it sends is the same size for all three fp16 hooks)."""
    bucket = torch.randn(n, device="cuda") * 1e-3
    grad = torch.empty(n, device="cuda")
    wire = torch.empty(n, dtype=torch.float16, device="cuda")
    factor = torch.full((1,), 1.0 / SCALE, device="cuda")

    def torch_hook() -> None:
        w = bucket.to(torch.float16).div_(world)
        bucket.copy_(w)
        grad.copy_(bucket)

    def aiak_scale1() -> None:
        wire.copy_(bucket)
        grad.copy_(wire)

    def aiak_scale10() -> None:
        torch.mul(bucket, SCALE, out=wire)
        torch.mul(wire, factor, out=bucket)
        grad.copy_(bucket)

    return [
        ("no hook (DDP copy)", lambda: grad.copy_(bucket)),
        ("torch fp16_compress_hook", torch_hook),
        ("aiak fp16_compress()", aiak_scale1),
        ("aiak fp16_compress(scale=10)", aiak_scale10),
    ]


def hooks_table(n: int, buckets: int = 12) -> list[dict]:
    rows = []
    for name, fn in _hook_pipelines(n):
        gpu = time_graph(fn)
        ms = gpu[1] if gpu else time_pipelined(fn)[1]
        rows.append({"n": n, "hook": name, "bucket_us": ms * 1e3})
    base = rows[0]["bucket_us"]
    for r in rows:
        r["extra_us"] = r["bucket_us"] - base
        r[f"extra_ms_x{buckets}"] = r["extra_us"] * buckets / 1e3
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16777216,6553600,1048576")
    p.add_argument("--hooks", action="store_true", help="also each fp16 hook's GPU work per bucket")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cast_scale: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (r+w)")
    rows = []
    for n in map(int, args.sizes.split(",")):
        for wire_dtype in (torch.float16, torch.bfloat16):
            for op, nbytes, ours, base in _cases(n, wire_dtype):
                row = {"n": n, "wire": str(wire_dtype).removeprefix("torch."), "op": op}
                for who, fn in (("ours", ours), ("torch", base)):
                    row[f"{who}_ms"] = time_pipelined(fn)[1]
                    gpu = time_graph(fn)
                    row[f"{who}_gpu_ms"] = gpu[1] if gpu else float("nan")
                    row[f"{who}_host_us"] = _host_us(fn)
                    gpu_ms = row[f"{who}_gpu_ms"]
                    gpu_ms = gpu_ms if gpu_ms == gpu_ms else row[f"{who}_ms"]
                    row[f"{who}_%copy"] = 100 * nbytes / (gpu_ms * 1e-3) / 1e9 / copy_gbs
                row["speedup"] = row["torch_gpu_ms"] / row["ours_gpu_ms"]
                row["copy_GBs"] = copy_gbs
                rows.append(row)
    append_csv("cast_scale", rows)
    print_table(
        rows,
        [
            "n",
            "wire",
            "op",
            "ours_gpu_ms",
            "torch_gpu_ms",
            "speedup",
            "ours_%copy",
            "torch_%copy",
            "ours_host_us",
            "torch_host_us",
        ],
    )
    if args.hooks:
        rows = hooks_table(int(args.sizes.split(",")[0]))
        append_csv("cast_scale_hooks", rows)
        print_table(rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
