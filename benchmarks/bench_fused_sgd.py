"""aiak::fused_sgd_ through aiak.optim.FusedSGD (momentum 0.9) vs torch SGD (fused, foreach)
and apex FusedSGD, one step on the ResNet-50 (161 tensors) and BERT-large (389) sets.

    python benchmarks/bench_fused_sgd.py [--sets resnet,bert]

Floor: 20 bytes per fp32 param (read p, g, buf; write p, buf). Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import math
import sys

import torch
from _compare import apex_module, cli, optimizer_step

from aiak.optim import FusedSGD

BYTES = 20
KW = {"lr": 0.1, "momentum": 0.9}


def cases(set_name, shapes):
    nbytes = BYTES * sum(math.prod(s) for s in shapes)
    yield "sgd", nbytes, "aiak FusedSGD", optimizer_step(lambda p: FusedSGD(p, **KW), shapes)
    for label, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        yield (
            "sgd",
            nbytes,
            label,
            optimizer_step(lambda p, kw=kw: torch.optim.SGD(p, **kw, **KW), shapes),
        )
    apex, _ = apex_module("apex.optimizers")
    if apex is not None:
        make = lambda p: apex.FusedSGD(p, **KW)  # noqa: E731
        yield "sgd", nbytes, "apex FusedSGD", optimizer_step(make, shapes)


def main(argv: list[str] | None = None) -> int:
    return cli("fused_sgd", cases, "apex.optimizers", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
