"""aiak.comm over a really slow link: 2 "nodes" in network namespaces joined by a tc-limited veth.

Needs root (ip netns, veth, tc). It creates the namespaces ``aiakbench0``/``aiakbench1`` and a
veth pair ``aiakv0``/``aiakv1`` (10.77.0.1 <-> 10.77.0.2), rate-limits both ends with ``tbf``,
runs N x G gloo ranks (ranks of one node inside one namespace, GLOO_SOCKET_IFNAME set to its
veth so intra-node pairs go over that namespace's loopback and only inter-node traffic crosses
the link), trains a DDP model for a few steps per mode, and reads the bytes that crossed from the
veth counters. Everything it creates is removed in ``finally``; each run has a time limit.

    sudo .venv/bin/python benchmarks/bench_comm_slow_link.py --rates 100,200,500,1000

Writes ``benchmarks/results/comm_slow_link.csv`` (appends) and ``comm_slow_link_<N>x<G>.png``
(without matplotlib, e.g. on the GPU machine, the plot is skipped: ``--replot`` draws it later
from the CSV's latest run of that layout). No iproute2 there: ``scripts/iproute2-bundle``.
Formula (per direction, per step, S = gradient bytes): flat ring 2(NG-1)/NG * S; hierarchical
2(N-1)/N * S; hierarchical + fp16 half of that; PowerSGD 2(NG-1)/NG * 4 B * sum((n+m) r) plus
uncompressed biases.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

NS = ("aiakbench0", "aiakbench1")
DEV = ("aiakv0", "aiakv1")
ADDR = ("10.77.0.1", "10.77.0.2")
RESULTS = Path(__file__).parent / "results"
MODES = (
    "flat",
    "hierarchical",
    "hierarchical+fp16",
    "powersgd-r1",
    "powersgd-r4",
    "dgc-0.001",
    "downsample-4",
    "flat+overlap",
)


# ------------------------------------------------------------------------------------------
# worker (one rank, inside a namespace)
# ------------------------------------------------------------------------------------------


def make_hook(mode: str):
    from aiak import comm

    return {
        "flat": comm.allreduce,
        "hierarchical": comm.hierarchical,
        "hierarchical+fp16": lambda: comm.hierarchical(outer=comm.fp16_compress(scale=10)),
        "powersgd-r1": lambda: comm.powersgd(rank=1, start_iter=2),
        "powersgd-r4": lambda: comm.powersgd(rank=4, start_iter=2),
        "dgc-0.001": lambda: comm.dgc(compress_ratio=0.001),
        "downsample-4": lambda: comm.downsample(n=4),
        "flat+overlap": comm.allreduce,  # with aiak.comm.overlap_step (the step in backward)
    }[mode]()


def link_bytes(dev: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / dev / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from aiak import comm

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=comm.gloo_timeout())
    layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    rows = []
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        model = nn.Sequential(*layers)
        ddp = nn.parallel.DistributedDataParallel(model)
        hook = make_hook(mode)
        if mode.startswith("dgc"):
            opt = comm.DGCSGD(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        overlap = mode.endswith("+overlap")
        if overlap:
            hook = comm.overlap_step(ddp, opt, hook=hook).hook
        else:
            comm.register(ddp, hook)
        x = torch.randn(args.batch, args.width)

        def step(ddp=ddp, opt=opt, x=x, overlap=overlap) -> None:
            opt.zero_grad()
            ddp(x).square().mean().backward()
            if not overlap:  # overlap_step stepped every bucket during backward
                opt.step()

        for _ in range(3):  # DDP rebuilds buckets at step 1; PowerSGD compresses from step 2
            step()
        dist.barrier()
        before = link_bytes(os.environ["GLOO_SOCKET_IFNAME"])
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        after = link_bytes(os.environ["GLOO_SOCKET_IFNAME"])
        dist.barrier()
        step_ms = torch.tensor(times) * 1e3
        dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
        if rank == 0:
            rows.append(
                {
                    "mode": mode,
                    "step_ms": statistics.median(step_ms.tolist()),
                    "tx_per_step": (after[0] - before[0]) / args.steps,
                    "rx_per_step": (after[1] - before[1]) / args.steps,
                    "hook_inter_rank0": hook.state.bytes_sent()["inter"],
                    "grad_bytes": 4 * sum(p.numel() for p in model.parameters()),
                    "formula": formula(mode, model, dist.get_world_size(), args.nodes),
                }
            )
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    comm.exit_rank(0)


def formula(mode: str, model, world: int, nodes: int) -> float:
    """Bytes per step crossing the link in one direction (ring schedules, 2 nodes)."""
    s = 4 * sum(p.numel() for p in model.parameters())
    ring = 2 * (world - 1) / world
    if mode in ("flat", "flat+overlap"):
        return ring * s
    if mode.startswith("downsample"):
        return ring * s / int(mode.rsplit("-", 1)[1])
    if mode.startswith("dgc"):
        # allgather of (fp32 value, int64 index) pairs: each rank's pairs cross once per
        # other rank on the ring ((P-1)/P of P x payload); vectors travel densely
        ratio = float(mode.rsplit("-", 1)[1])
        pairs = sum(math.ceil(p.numel() * ratio) for p in model.parameters() if p.dim() > 1)
        dense = sum(p.numel() for p in model.parameters() if p.dim() <= 1)
        return (world - 1) * 12 * pairs + ring * 4 * dense
    if mode.startswith("hierarchical"):
        two_level = 2 * (nodes - 1) / nodes * s
        return two_level / 2 if mode.endswith("fp16") else two_level
    r = int(mode.rsplit("r", 1)[1])
    floats = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        k = min(n, m, r)
        floats += (n + m) * k if (n + m) * k * 2 < n * m else p.numel()  # min_compression_rate 2
    return ring * 4 * floats


# ------------------------------------------------------------------------------------------
# driver (root namespace)
# ------------------------------------------------------------------------------------------


def sh(cmd: str, check: bool = True) -> None:
    subprocess.run(cmd.split(), check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def setup_link(ns: tuple[str, str] = NS) -> None:
    """Two namespaces ``ns`` joined by the veth pair DEV (the device names live inside them,
    so only the namespace names must be unique on the machine)."""
    teardown_link(ns)
    for name in ns:
        sh(f"ip netns add {name}")
        sh(f"ip -n {name} link set lo up")
    sh(f"ip link add {DEV[0]} netns {ns[0]} type veth peer name {DEV[1]} netns {ns[1]}")
    for name, dev, addr in zip(ns, DEV, ADDR):
        sh(f"ip -n {name} addr add {addr}/24 dev {dev}")
        sh(f"ip -n {name} link set {dev} up")


def set_rate(mbit: int, ns: tuple[str, str] = NS) -> None:
    # tbf on each end shapes that end's egress: both directions run at `mbit`. The burst must
    # hold at least rate/HZ bytes; 256 KiB keeps 1 Gbit/s reachable (measured below), 2 ms of
    # traffic above that.
    burst = max(256 * 1024, mbit * 1_000_000 // 8 // 500)
    for name, dev in zip(ns, DEV):
        sh(
            f"ip netns exec {name} tc qdisc replace dev {dev} root tbf rate {mbit}mbit "
            f"burst {burst} latency 100ms"
        )


def teardown_link(ns: tuple[str, str] = NS) -> None:
    for name in ns:  # deleting a namespace deletes its veth end and the pair with it
        sh(f"ip netns del {name}", check=False)


def run_rate(args: argparse.Namespace, mbit: int, tmp: Path) -> list[dict]:
    set_rate(mbit)
    world = args.nodes * args.per_node
    out = tmp / f"rate{mbit}.json"
    port = 29700 + mbit % 200
    procs = []
    for rank in range(world):
        node = rank // args.per_node
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            GROUP_RANK=str(node),
            LOCAL_WORLD_SIZE=str(args.per_node),
            LOCAL_RANK=str(rank % args.per_node),
            MASTER_ADDR=ADDR[0],
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=DEV[node],
            GLOO_TIMEOUT_SECONDS="120",
            OMP_NUM_THREADS="1",
        )
        cmd = [
            "ip",
            "netns",
            "exec",
            NS[node],
            sys.executable,
            __file__,
            "--worker",
            "--out",
            str(out),
            "--modes",
            args.modes,
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--nodes",
            str(args.nodes),
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.limit
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{mbit} Mbit/s: ranks did not finish in {args.limit} s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mbit} Mbit/s: a rank failed: {[p.returncode for p in procs]}")
    rows = json.loads(out.read_text())
    for r in rows:
        r.update(link_mbit=mbit, nodes=args.nodes, per_node=args.per_node)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["link_mbit"], r["step_ms"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    n, g = rows[0]["nodes"], rows[0]["per_node"]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="inter-node link (Mbit/s, tc tbf)",
        ylabel="DDP step time (ms, median)",
        title=f"aiak.comm on gloo, {n} nodes x {g} ranks, "
        f"{rows[0]['grad_bytes'] / 2**20:.1f} MiB of gradients",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _png(args: argparse.Namespace) -> Path:
    return RESULTS / f"comm_slow_link_{args.nodes}x{args.per_node}.png"


def latest_rows(nodes: int, per_node: int) -> list[dict]:
    """The rows of the CSV's latest run with this layout, numbers as numbers."""
    with (RESULTS / "comm_slow_link.csv").open(newline="") as f:
        rows = [
            r
            for r in csv.DictReader(f)
            if (int(r["nodes"]), int(r["per_node"])) == (nodes, per_node)
        ]
    if not rows:
        sys.exit(f"bench_comm_slow_link: no {nodes} x {per_node} rows in comm_slow_link.csv")
    last = rows[-1]["timestamp"]
    out = []
    for r in rows:
        if r["timestamp"] == last:
            out.append(
                {k: v if k in ("timestamp", "host", "mode") else float(v) for k, v in r.items()}
            )
    for r in out:
        r["link_mbit"], r["nodes"], r["per_node"] = int(r["link_mbit"]), nodes, per_node
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--rates", default="100,200,500,1000", help="link rates in Mbit/s")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--limit", type=float, default=300, help="seconds per link rate")
    p.add_argument("--replot", action="store_true", help="plot the CSV's latest run, no runs")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.replot:
        plot(latest_rows(args.nodes, args.per_node), _png(args))
        return
    if os.geteuid() != 0:
        sys.exit("bench_comm_slow_link: needs root (ip netns, veth, tc)")
    if args.nodes != 2:
        sys.exit("bench_comm_slow_link: the link joins exactly 2 namespaces (--nodes 2)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path("/tmp") / f"aiak_bench_{os.getpid()}"
    tmp.mkdir()
    rows: list[dict] = []
    try:
        setup_link()
        for mbit in (int(r) for r in args.rates.split(",")):
            rows += run_rate(args, mbit, tmp)
            print(f"{mbit} Mbit/s done", flush=True)
    finally:
        teardown_link()
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    fields = [
        "timestamp",
        "host",
        "link_mbit",
        "nodes",
        "per_node",
        "mode",
        "step_ms",
        "tx_per_step",
        "rx_per_step",
        "formula",
        "tx_over_formula",
        "hook_inter_rank0",
        "grad_bytes",
    ]
    csv_path = RESULTS / "comm_slow_link.csv"
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        for r in rows:
            r.update(
                timestamp=stamp,
                host=socket.gethostname(),
                tx_over_formula=r["tx_per_step"] / r["formula"],
            )
            w.writerow({k: r[k] for k in fields})
    try:
        plot(rows, _png(args))
    except ImportError:
        print("matplotlib is missing: no plot (run again with --replot where it is installed)")
    flat = {r["link_mbit"]: r["step_ms"] for r in rows if r["mode"] == "flat"}
    print(
        f"\n{'Mbit/s':>6} {'mode':<18} {'step ms':>8} {'vs flat':>7} {'MB/step tx':>10} "
        f"{'formula MB':>10} {'tx/formula':>10}"
    )
    for r in rows:
        print(
            f"{r['link_mbit']:>6} {r['mode']:<18} {r['step_ms']:>8.1f} "
            f"{flat.get(r['link_mbit'], float('nan')) / r['step_ms']:>6.2f}x "
            f"{r['tx_per_step'] / 1e6:>10.3f} {r['formula'] / 1e6:>10.3f} "
            f"{r['tx_per_step'] / r['formula']:>10.2f}"
        )


if __name__ == "__main__":
    main()
