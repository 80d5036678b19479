"""The multi-tensor ops side by side: bench_multi_tensor_l2norm.py and
bench_multi_tensor_scale.py, each with torch's foreach ops and apex's amp_C in the same run.

    python benchmarks/bench_multi_tensor.py [--sets resnet,bert]

Per row: back-to-back ms, GPU ms (profiler), their ratio, % of copy bandwidth
(benchmarks/_compare.py).
"""

from __future__ import annotations

import argparse
import sys

import bench_multi_tensor_l2norm
import bench_multi_tensor_scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="resnet,bert")
    args = ap.parse_args(argv)
    rc = bench_multi_tensor_l2norm.main(["--sets", args.sets])
    return max(rc, bench_multi_tensor_scale.main(["--sets", args.sets]))


if __name__ == "__main__":
    sys.exit(main())
