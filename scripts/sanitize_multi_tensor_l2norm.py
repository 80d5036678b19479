"""A tiny run of the one-launch L2 norm, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_multi_tensor_l2norm.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_multi_tensor_l2norm.py

Tensors of one and several chunks, empty ones, fp16 next to fp32; three calls on one kept
workspace (its tickets must be back at zero each time), ``BoundNorm``'s kept table, and a list
without elements (a grid of one block and no chunk). Each result is compared with float64 on the
CPU; exits non-zero when one differs.
"""

from __future__ import annotations

import sys

import torch

import aiak.ops
from aiak.ops.multi_tensor_l2norm import BoundNorm


def main() -> int:
    torch.manual_seed(0)
    sizes = (0, 5, 65_536, 200_001, 3, 0)
    ts = [torch.randn(n, device="cuda") for n in sizes]
    ts.append(torch.randn(70_000, device="cuda").half())
    ref = torch.stack([t.double().norm() for t in ts]).cpu()
    total_ref = ref.norm().item()
    bad = 0
    for _ in range(3):
        total, per = aiak.ops.multi_tensor_l2norm(ts, True)
        bad += not torch.allclose(per.double().cpu(), ref, rtol=1e-5)
        bad += abs(total.item() - total_ref) > 1e-5 * total_ref
    bound = BoundNorm()
    for _ in range(3):
        bad += abs(bound(ts).item() - total_ref) > 1e-5 * total_ref
    empty, _ = aiak.ops.multi_tensor_l2norm([torch.empty(0, device="cuda")], True)
    bad += empty.item() != 0.0
    print(f"multi_tensor_l2norm: {bad} wrong results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
