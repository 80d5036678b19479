"""aiak::fused_sgd_ through aiak.optim.FusedSGD (momentum 0.9) vs torch SGD (fused, foreach)
and apex FusedSGD, one step on the ResNet-50 (161 tensors) and BERT-large (389) sets.

    python benchmarks/bench_fused_sgd.py [--sets resnet,bert]

Floor: 20 bytes per fp32 param (read p, g, buf; write p, buf). Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from _compare import apex_module, run

from aiak.optim import FusedSGD

BYTES = 20
KW = {"lr": 0.1, "momentum": 0.9}


def step_of(make, shapes):
    params = [torch.randn(s, device="cuda").requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    opt.step()  # state, tables, compilation
    return opt.step


def cases(set_name, shapes):
    nbytes = BYTES * sum(math.prod(s) for s in shapes)
    yield "sgd", nbytes, "aiak FusedSGD", step_of(lambda p: FusedSGD(p, **KW), shapes)
    for label, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        yield "sgd", nbytes, label, step_of(lambda p, kw=kw: torch.optim.SGD(p, **kw, **KW), shapes)
    apex, _ = apex_module("apex.optimizers")
    if apex is not None:
        make = lambda p: apex.FusedSGD(p, **KW)  # noqa: E731
        yield "sgd", nbytes, "apex FusedSGD", step_of(make, shapes)


def notes():
    _, why = apex_module("apex.optimizers")
    return [f"apex rows skipped: {why}"] if why else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="resnet,bert")
    args = ap.parse_args(argv)
    return run("fused_sgd", cases, args.sets, notes())


if __name__ == "__main__":
    sys.exit(main())
