"""The optimizer steps side by side: bench_fused_adam.py (AdamW), bench_fused_sgd.py (SGD
momentum), bench_fused_lamb.py (LAMB), each with torch fused/foreach and apex in the same run.

    python benchmarks/bench_optim.py [--sets resnet,bert] [--opts adamw,sgd,lamb]

Per row: back-to-back ms, GPU ms (profiler), their ratio, % of copy bandwidth
(benchmarks/_compare.py). The ResNet-50 set (161 tensors) shows the host path; BERT-large (389)
the kernels' bandwidth.
"""

from __future__ import annotations

import argparse
import sys

import bench_fused_adam
import bench_fused_lamb
import bench_fused_sgd

BENCHES = {"adamw": bench_fused_adam, "sgd": bench_fused_sgd, "lamb": bench_fused_lamb}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="resnet,bert")
    ap.add_argument("--opts", default="adamw,sgd,lamb")
    args = ap.parse_args(argv)
    rc = 0
    for name in args.opts.split(","):
        rc = max(rc, BENCHES[name].main(["--sets", args.sets]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
