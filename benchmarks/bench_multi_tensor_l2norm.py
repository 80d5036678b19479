"""aiak::multi_tensor_l2norm (per-tensor and total norms of a whole list) vs torch's
``_foreach_norm`` + stack and apex's ``amp_C.multi_tensor_l2norm``, on the ResNet-50 (161
tensors) and BERT-large (389) sets, fp32; and ``BoundNorm``, the total over a list whose
tensors stay put from call to call.

    python benchmarks/bench_multi_tensor_l2norm.py [--sets resnet,bert]

Floor: 4 bytes per element (read once). Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import math
import sys

import torch
from _compare import apex_module, cli

import aiak.ops
from aiak.ops.multi_tensor_l2norm import BoundNorm


def cases(set_name, shapes):
    ts = [torch.randn(s, device="cuda") for s in shapes]
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    yield "l2norm", nbytes, "aiak", lambda: aiak.ops.multi_tensor_l2norm(ts, True)
    # The stable-set path (LAMB's grad norm, clipping in a loop): the total only, the device
    # table kept while the addresses stay those of the last call.
    bound = BoundNorm()
    yield "l2norm", nbytes, "aiak BoundNorm", lambda: bound(ts)

    def foreach() -> None:
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))

    yield "l2norm", nbytes, "torch foreach", foreach
    amp_c, _ = apex_module("amp_C")
    if amp_c is not None:
        from apex.multi_tensor_apply import multi_tensor_applier

        flag = torch.zeros(1, dtype=torch.int, device="cuda")
        yield (
            "l2norm",
            nbytes,
            "apex amp_C",
            lambda: multi_tensor_applier(amp_c.multi_tensor_l2norm, flag, [ts], True),
        )


def main(argv: list[str] | None = None) -> int:
    return cli("multi_tensor_l2norm", cases, "amp_C", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
