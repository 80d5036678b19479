"""aiak::fused_adam_ through aiak.optim.FusedAdamW vs torch's AdamW (fused, foreach) and apex's
FusedAdam, one step on the ResNet-50 (161 tensors) and BERT-large (389) sets.

    python benchmarks/bench_fused_adam.py [--sets resnet,bert]

Floor: 28 bytes per fp32 param (read p, g, m, v; write p, m, v). Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import math
import sys

import torch
from _compare import apex_module, cli, optimizer_step

from aiak.optim import FusedAdamW

BYTES = 28
KW = {"lr": 1e-3, "weight_decay": 0.01}


def cases(set_name, shapes):
    nbytes = BYTES * sum(math.prod(s) for s in shapes)
    yield "adamw", nbytes, "aiak FusedAdamW", optimizer_step(lambda p: FusedAdamW(p, **KW), shapes)
    for label, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        yield (
            "adamw",
            nbytes,
            label,
            optimizer_step(lambda p, kw=kw: torch.optim.AdamW(p, **kw, **KW), shapes),
        )
    apex, _ = apex_module("apex.optimizers")
    if apex is not None:
        make = lambda p: apex.FusedAdam(p, adam_w_mode=True, **KW)  # noqa: E731
        yield "adamw", nbytes, "apex FusedAdam", optimizer_step(make, shapes)


def main(argv: list[str] | None = None) -> int:
    return cli("fused_adam", cases, "apex.optimizers", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
