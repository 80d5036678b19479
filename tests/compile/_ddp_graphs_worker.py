"""One rank of the graphed-DDP test (run by test_recipes_e2e.py under torchrun; not collected).

    python -m torch.distributed.run --nproc_per_node 2 _ddp_graphs_worker.py RECIPE AIAK HOOK

A recipe's tiny model trains twice on this NCCL group from the same weights and data: eager
DDP, and the model graphed by ``Run.graph`` then wrapped in DDP (the recipes' order under a
launcher). Each rank sees other images (rank 1 flips them), so only the allreduce keeps the
replicas equal. Checks on every rank: the graphed run's losses and weights follow the eager
run's, and its weights are bitwise the same on both ranks. Prints ``rank R: OK``.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from aiak import comm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))

RANK, LOCAL = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
STEPS = 4


def train(recipe, aiak: bool, hook: str, graphed: bool) -> tuple[list, list, float]:
    dev = torch.device("cuda", LOCAL)
    run = recipe.build(aiak=aiak, tiny=True, device=dev, batch=4)
    own = run.next_batch

    def next_batch():  # rank 1 trains on mirrored images
        x, y = own()
        return (x.flip(-1) if RANK else x), y

    run.next_batch = next_batch
    if graphed:
        run.graph()
    else:
        run.next_batch()  # graph() takes one batch to learn the inputs: same data from here
    run.ddp()
    if hook == "fp16":
        comm.register(run.forward, comm.fp16_compress())
    losses = [run.step() for _ in range(STEPS)]
    params = [p.detach().float().clone() for p in run.model.parameters()]
    lr = max(g["lr"] for g in run.optimizer.param_groups)
    adaptive = any(k in type(run.optimizer).__name__ for k in ("Adam", "LAMB"))
    return losses, params, (8 * lr if adaptive else 1e-3)


def main() -> None:
    name, aiak, hook = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    torch.cuda.set_device(LOCAL)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    try:
        recipe = __import__(name)
        losses, params, atol = train(recipe, aiak, hook, graphed=False)
        losses_g, params_g, _ = train(recipe, aiak, hook, graphed=True)
        # the ranks' data differ: their first losses do too
        first = torch.empty(dist.get_world_size(), device=losses_g[0].device)
        dist.all_gather_into_tensor(first, losses_g[0].float().reshape(1))
        assert first[0] != first[1], f"rank {RANK}: both ranks saw the same data {first}"
        for step, (a, b) in enumerate(zip(losses_g, losses, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3, msg=f"loss, step {step}")
        for i, (a, b) in enumerate(zip(params_g, params, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=atol, msg=f"param {i}")
        # replicas stay equal only through the allreduce of the graphed gradients
        for i, p in enumerate(params_g):
            other = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(other, p)
            assert torch.equal(other[0], other[1]), f"rank {RANK}: param {i} differs across ranks"
        torch.cuda.synchronize()
        print(f"rank {RANK}: OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
