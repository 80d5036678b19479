"""DGC and gossip downsampling on 4 gloo CPU ranks reach dense SGD's accuracy (sklearn digits).

    python examples/dgc_digits.py [--epochs 20] [--seeds 0,1,2] [--hidden 1024] [--lr 0.1]

8x8 handwritten digits (ship with scikit-learn; 1,437 train / 360 test), split over 4 ranks; a
bias-free 64-1024-10 MLP (DGC compresses tensors with dim > 1 only: without biases every
gradient byte goes through it). Three runs in one process group, each from the same weights:

* dense: DDP allreduce (aiak.comm.allreduce, for its byte counter), SGD momentum 0.9;
* dgc: aiak.comm.dgc(compress_ratio=0.001, fp16_values=True, int32_indices=True) with
  aiak.comm.DGCSGD (momentum in DGC's memory);
* downsample: aiak.comm.downsample(n=4, momentum=0.9), SGD momentum 0.9 (gradient momentum 0.9
  damps the burst an element's four delayed steps make when it travels: docs/dgc.md).

Prints each run's test accuracy and the gradient bytes rank 0 sent (counted by the hooks), and
the ratios; with several seeds (each its own data split, weights and batch order), each seed's
accuracy and the mean, since 360 test images make one seed's figure move by a point or two.
docs/dgc.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

WORLD = 4


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images (scaled to [0, 1]) and labels."""
    from sklearn.datasets import load_digits  # optional dependency: the example needs it

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(data.target, dtype=torch.int64)


def load(seed: int, path: str | None = None) -> tuple[torch.Tensor, ...]:
    """Train and test split for ``seed``; ``path``: ``digits()`` saved by the launcher, so the
    ranks do not each import scikit-learn."""
    x, y = torch.load(path) if path else digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return x[360:], y[360:], x[:360], y[:360]


def net(seed: int, hidden: int = 1024) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 10, bias=False)
    )


def run_mode(
    mode: str,
    epochs: int,
    seed: int,
    rank: int,
    hidden: int = 1024,
    data: str | None = None,
    lr: float = 0.1,
) -> dict:
    from aiak import comm

    xtr, ytr, xte, yte = load(seed, data)
    xtr, ytr = xtr[rank::WORLD], ytr[rank::WORLD]
    model = net(seed, hidden)
    ddp = nn.parallel.DistributedDataParallel(model)
    batch = 16
    if mode == "dgc":
        hook = comm.dgc(compress_ratio=0.001, fp16_values=True, int32_indices=True)
        opt: torch.optim.Optimizer = comm.DGCSGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        hook = comm.downsample(n=4, momentum=0.9) if mode == "downsample" else comm.allreduce()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    comm.register(ddp, hook)
    g = torch.Generator().manual_seed(seed)
    steps = len(xtr) // batch
    for epoch in range(epochs):
        if mode == "dgc":
            hook.state.set_epoch(epoch)
        perm = torch.randperm(len(xtr), generator=g)
        for s in range(steps):
            idx = perm[s * batch : (s + 1) * batch]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).double().mean()) * 100
    b = hook.state.bytes_sent()
    return {"accuracy": acc, "bytes": b["intra_total"] + b["inter_total"]}


def worker(
    out: str, epochs: int, seeds: list[int], hidden: int, data: str | None, lr: float
) -> None:
    import torch.distributed as dist

    from aiak import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    rank = dist.get_rank()
    results: dict[str, dict] = {}
    for seed in seeds:
        runs = results[str(seed)] = {}
        for mode in ("dense", "dgc", "downsample"):
            t = time.perf_counter()
            runs[mode] = run_mode(mode, epochs, seed, rank, hidden, data, lr)
            runs[mode]["seconds"] = round(time.perf_counter() - t, 1)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    comm.shutdown()  # DDP models and hook states release the groups before they are destroyed


def launch(
    epochs: int,
    seeds: list[int] | tuple[int, ...] = (0,),
    limit: float = 300.0,
    hidden: int = 1024,
    lr: float = 0.1,
) -> dict[str, dict]:
    """Run the 4 ranks as subprocesses; every one is joined or killed within ``limit``.
    Returns ``{str(seed): {mode: {"accuracy", "bytes", "seconds"}}}``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        data = str(Path(tmp) / "digits.pt")
        torch.save(digits(), data)
        procs = []
        for rank in range(WORLD):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            cmd = [sys.executable, __file__, "--worker", out, "--data", data]
            cmd += ["--epochs", str(epochs)]
            cmd += ["--seeds", ",".join(map(str, seeds)), "--hidden", str(hidden)]
            cmd += ["--lr", repr(lr)]
            procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE))
        deadline = time.monotonic() + limit
        errors = []
        try:
            for p in procs:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                if p.returncode:
                    errors.append(err.decode()[-2000:])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if errors:
            raise RuntimeError("dgc_digits ranks failed:\n" + "\n".join(errors))
        return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--worker", default=None)
    p.add_argument("--data", default=None)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.worker:
        worker(args.worker, args.epochs, seeds, args.hidden, args.data, args.lr)
        return
    r = launch(args.epochs, seeds, limit=300.0 * len(seeds), hidden=args.hidden, lr=args.lr)
    for seed, runs in r.items():
        dense = runs["dense"]
        for mode, v in runs.items():
            print(
                f"seed {seed} {mode:>10}: accuracy {v['accuracy']:.2f}%  gradient bytes sent by "
                f"rank 0 {v['bytes']:>12,}  ({dense['bytes'] / v['bytes']:.1f}x fewer than "
                f"dense)  {v['seconds']} s"
            )
    if len(seeds) > 1:
        for mode in ("dense", "dgc", "downsample"):
            accs = [runs[mode]["accuracy"] for runs in r.values()]
            gaps = [runs[mode]["accuracy"] - runs["dense"]["accuracy"] for runs in r.values()]
            print(
                f"mean {mode:>10}: accuracy {sum(accs) / len(accs):.2f}%  vs dense "
                f"{sum(gaps) / len(gaps):+.2f} points (per seed "
                + ", ".join(f"{g:+.2f}" for g in gaps)
                + ")"
            )


if __name__ == "__main__":
    main()
