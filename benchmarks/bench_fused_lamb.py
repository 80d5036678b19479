"""aiak::fused_lamb_ (with the global norm, aiak::multi_tensor_l2norm) through aiak.optim.LAMB vs
apex's FusedLAMB, one step on the ResNet-50 (161 tensors) and BERT-large (389) sets.

    python benchmarks/bench_fused_lamb.py [--sets resnet,bert]

torch has no LAMB. Floor: 44 bytes per fp32 param (norm: read g; stage 1: read p, g, m, v,
write m, v, u; stage 2: read p, u, write p). Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import math
import sys

from _compare import apex_module, cli, optimizer_step

from aiak.optim import LAMB

BYTES = 44
KW = {"lr": 1e-3, "weight_decay": 0.01}


def cases(set_name, shapes):
    nbytes = BYTES * sum(math.prod(s) for s in shapes)
    yield "lamb", nbytes, "aiak LAMB", optimizer_step(lambda p: LAMB(p, **KW), shapes)
    apex, _ = apex_module("apex.optimizers")
    if apex is not None:
        make = lambda p: apex.FusedLAMB(p, **KW)  # noqa: E731
        yield "lamb", nbytes, "apex FusedLAMB", optimizer_step(make, shapes)


def main(argv: list[str] | None = None) -> int:
    return cli("fused_lamb", cases, "apex.optimizers", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
