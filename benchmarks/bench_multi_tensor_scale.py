"""aiak::multi_tensor_scale_ (copy + scale + inf check over a whole list) vs torch's foreach ops
and apex's ``amp_C.multi_tensor_scale``, on the ResNet-50 (161 tensors) and BERT-large (389)
sets: fp32 out of place, and amp's fp16 grads -> fp32 masters.

    python benchmarks/bench_multi_tensor_scale.py [--sets resnet,bert]

Floor: read src + write dst once. Columns: benchmarks/_compare.py.
"""

from __future__ import annotations

import math
import sys

import torch
from _compare import apex_module, cli

import aiak.ops


def cases(set_name, shapes):
    n = sum(math.prod(s) for s in shapes)
    s = torch.tensor(0.5, device="cuda")
    found = torch.zeros(1, device="cuda")
    amp_c, _ = apex_module("amp_C")
    if amp_c is not None:
        from apex.multi_tensor_apply import multi_tensor_applier
    for op, src_dtype in (("scale fp32", torch.float32), ("scale fp16->fp32", torch.float16)):
        src = [torch.randn(sh, device="cuda").to(src_dtype) for sh in shapes]
        dst = [torch.empty_like(t, dtype=torch.float32) for t in src]
        nbytes = n * (src[0].element_size() + 4)
        yield (
            op,
            nbytes,
            "aiak",
            lambda src=src, dst=dst: aiak.ops.multi_tensor_scale_(src, dst, s, found),
        )

        def torch_two_pass(src=src, dst=dst) -> None:
            torch._foreach_copy_(dst, src)
            torch._amp_foreach_non_finite_check_and_unscale_(dst, found, s)

        yield op, nbytes, "torch foreach", torch_two_pass
        if amp_c is not None:
            flag = torch.zeros(1, dtype=torch.int, device="cuda")
            yield (
                op,
                nbytes,
                "apex amp_C",
                lambda src=src, dst=dst, flag=flag: multi_tensor_applier(
                    amp_c.multi_tensor_scale, flag, [src, dst], 0.5
                ),
            )


def main(argv: list[str] | None = None) -> int:
    return cli("multi_tensor_scale", cases, "amp_C", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
