"""aiak.comm across 2 "nodes" of one GPU machine: NVLink inside a node, a socket link between.

Modes (``--modes``, default all): DDP's allreduce, aiak's flat allreduce, hierarchical (+ fp16),
PowerSGD rank 1 and 4, DGC 0.001, downsampling n=4, and the backward/step overlap
(``--overlap-backward-and-step``) with FusedSGD and with DGC, each beside its base mode: the
report's ``opt_ms`` is the base mode's optimizer step alone and ``opt_hidden`` the share of it
that the overlap removes from the step. ``local_ms`` is the same training step with no exchange
(``ddp.no_sync()``): the floor under every mode, so ``flat / local_ms`` bounds any mode's gain.
``bwd_host_ms`` / ``local_bwd_host_ms``: the host time of the ``backward()`` call in the step
and in the no-exchange step (the hooks' host work is the difference).
``--per-node 1`` runs 2 nodes x 1 GPU.
``--advise MODEL`` runs only ``aiak-advise --verify`` on that model's plain DDP job over the
two nodes (its report printed, and kept beside ``--json``).

Each node is a network namespace (``aiaknode0-<pid>``/``aiaknode1-<pid>``) joined to the other
by a veth pair, optionally rate-limited with ``tc``. Every mode is one ``aiakrun`` job over both
namespaces (``--remote-shell`` enters the node's namespace), its features switched on by
aiakrun's flags only (downsampling, which has no flag, by the variable aiakrun forwards); the
training script (``_nodes_worker.py``) is plain torch (FusedSGD where a mode names it). Per node the
remote shell sets ``CUDA_VISIBLE_DEVICES`` to the node's GPUs and a distinct ``NCCL_HOSTID``:
NCCL then treats the namespaces as separate hosts, keeps NVLink (P2P) between the GPUs of a node
and sends everything between nodes through its socket transport over the veth
(``NCCL_SOCKET_IFNAME``, InfiniBand off). On a machine without GPUs the ranks run gloo on CPU.

    sudo python3 benchmarks/bench_comm_nodes.py --per-node 2 --models linear,resnet50

Models: ``linear`` = 12 x Linear(4096, 4096) (805 MB of fp32 gradients), ``resnet50`` =
torchvision ResNet-50 (102 MB), ``tiny`` = 3 x Linear(64, 64) (for a quick check); batch 32
per rank, SGD. Reported per model and mode: the median step time, the relative error of one
step's averaged gradient against the exact no-hook average (and torch's fp16 hook's error, the
bound for fp16 wires), the bytes the hook sent per step per stage (all ranks), and the bytes
that left the nodes through the link. Appends to ``benchmarks/results/comm_nodes.csv`` and
draws ``comm_nodes_<N>x<G>[_<rate>mbit].png`` (skipped without matplotlib; ``--replot`` later).
A mode that fails is reported and the next one runs; a run stopped by SIGTERM (``timeout``) or
^C removes its namespaces and still writes the modes it finished (exit code 1 either way).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_comm_slow_link import ADDR, DEV, set_rate, setup_link, teardown_link

RESULTS = Path(__file__).resolve().parent / "results"
# One namespace per node, named per run: runs at the same time on one machine do not collide
# (the veth devices and addresses live inside the namespaces).
NS = (f"aiaknode0-{os.getpid()}", f"aiaknode1-{os.getpid()}")
WORKER = Path(__file__).resolve().parent / "_nodes_worker.py"
# mode -> aiakrun flags (nothing else switches a feature on, but for MODE_ENV below)
MODES: dict[str, list[str]] = {
    "DDP allreduce": [],
    "flat": ["--comm-log-steps", "1000000"],  # aiak's allreduce hook, registered to count bytes
    "hierarchical": ["--hierarchical-allreduce"],
    "hierarchical+fp16": ["--hierarchical-allreduce", "--fp16-compression"],
    "powersgd-r1": ["--powersgd", "--powersgd-rank", "1", "--start-compress-iter", "2"],
    "powersgd-r4": ["--powersgd", "--powersgd-rank", "4", "--start-compress-iter", "2"],
    "dgc-0.001": ["--dgc", "--compress-ratio", "0.001"],
    # --dgc builds DDP with 50 MiB buckets (aiak.comm.DGC_BUCKET_MB; ResNet-50's gradients
    # in two); these rows set another size: DDP's 25 MiB, one bucket, and the flat allreduce in
    # one bucket
    "dgc-0.001-bucket25": ["--dgc", "--compress-ratio", "0.001", "--allreduce-fusion", "25"],
    "dgc-0.001-bucket128": ["--dgc", "--compress-ratio", "0.001", "--allreduce-fusion", "128"],
    "flat-bucket128": ["--comm-log-steps", "1000000", "--allreduce-fusion", "128"],
    "downsample-4": [],  # PERSEUS_DOWNSAMPLE_N_ELEMENTS=4 (MODE_ENV): aiakrun has no flag for it
    "fused-sgd": ["--comm-log-steps", "1000000"],  # the overlap's baseline: flat, FusedSGD
    "overlap": ["--overlap-backward-and-step"],
    "dgc-0.001+overlap": ["--dgc", "--compress-ratio", "0.001", "--overlap-backward-and-step"],
}
# variables a mode adds to aiakrun's environment (aiakrun forwards PERSEUS_* to every rank)
MODE_ENV: dict[str, dict[str, str]] = {"downsample-4": {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4"}}
# the training script's optimizer per mode (default: torch SGD with momentum)
MODE_OPTIMIZER = {"fused-sgd": "fused-sgd", "overlap": "fused-sgd"}
# an overlap mode -> the same mode without the overlap: how much of that mode's optimizer time
# (opt_ms) leaves the step is (step_ms(base) - step_ms(overlap)) / opt_ms(base)
OVERLAP_BASE = {"overlap": "fused-sgd", "dgc-0.001+overlap": "dgc-0.001"}
# Multi-GPU processes keep NVLink multicast off, whatever environment they start with.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LOSSLESS = {"DDP allreduce", "flat", "hierarchical", "fused-sgd", "overlap"}
FIELDS = [
    "timestamp",
    "host",
    "device",
    "nodes",
    "per_node",
    "link_mbit",
    "model",
    "mode",
    "step_ms",
    "local_ms",
    "bwd_host_ms",
    "local_bwd_host_ms",
    "vs_flat",
    "rel_err",
    "tol",
    "check",
    "rel_err_torch_fp16",
    "intra_bytes_per_step",
    "inter_bytes_per_step",
    "link_tx_per_step",
    "grad_bytes",
    "opt_ms",
    "opt_hidden",
]


def remote_shell(tmp: Path, per_node: int, gpus: int) -> str:
    """A remote shell that enters a node's namespace with that node's devices and NCCL setup."""
    lines = ["#!/bin/sh", 'node="$1"; shift', 'case "$node" in']
    for i, (ns, dev) in enumerate(zip(NS, DEV)):
        env = {
            "NCCL_HOSTID": f"aiaknode{i}",
            "NCCL_SOCKET_IFNAME": dev,
            "GLOO_SOCKET_IFNAME": dev,
            "NCCL_IB_DISABLE": "1",
            **NO_MULTICAST,
        }
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * per_node + g) for g in range(per_node))
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"  {ns}) export {exports} ;;")
    lines += ['  *) echo "unknown node $node" >&2; exit 2 ;;', "esac"]
    lines.append('exec ip netns exec "$node" sh -c "$1"')
    path = tmp / "enter-node.sh"
    path.write_text("\n".join(lines) + "\n")
    return f"sh {path} {{host}}"


def kill_left(ns: tuple[str, ...]) -> None:
    """SIGKILL whatever still runs in the namespaces (aiakrun starts each host's launcher in a
    process group of its own, which a kill of aiakrun's group misses)."""
    for name in ns:
        out = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30
        )
        for pid in out.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def job_env(port: int) -> dict[str, str]:
    """aiakrun's environment for a job over the nodes: no aiak feature variable, none of a
    node's own settings (its remote shell sets those), multicast off."""
    own = ("CUDA_VISIBLE_DEVICES", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIAK_", "PERSEUS_")) and k not in own
    }
    env.update(PERSEUS_MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_TIMEOUT_SECONDS="120")
    env.update(NO_MULTICAST)
    return env


def run_mode(args, mode: str, shell: str, tmp: Path, port: int) -> list[dict]:
    out = tmp / f"{mode}.json"
    hosts = ",".join(f"{ns}={addr}:{args.per_node}" for ns, addr in zip(NS, ADDR))
    argv = [sys.executable, "-m", "aiak.launch.run", "-H", hosts, "--remote-shell", shell]
    argv += ["--rdzv-timeout", "120", *MODES[mode], "--", sys.executable, str(WORKER)]
    argv += ["--models", args.models, "--steps", str(args.steps), "--out", str(out)]
    argv += ["--warmup", str(args.warmup), "--optimizer", MODE_OPTIMIZER.get(mode, "sgd")]
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        argv += ["--trace", str(Path(args.trace) / mode.replace(" ", "_"))]
    env = job_env(port)
    env.update(MODE_ENV.get(mode, {}))
    log = tmp / f"{mode}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            code = None
        except BaseException:  # stopped (SIGTERM, ^C): the job goes with this script
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise
    if code != 0 or not out.exists():
        tail = log.read_text()[-4000:]
        why = f"timed out after {args.limit} s" if code is None else f"exit code {code}"
        raise RuntimeError(f"bench_comm_nodes: mode {mode!r}: aiakrun {why}\n{tail}")
    rows = json.loads(out.read_text())
    for r in rows:
        r["mode"] = mode
    return rows


def run_advise(args, shell: str, tmp: Path, port: int) -> int:
    """``aiak-advise --verify`` on the plain DDP job (no aiak flag) of ``--advise``'s model
    over the two nodes: its report is printed and kept in ``<--json>.advise.txt``."""
    hosts = ",".join(f"{ns}={addr}:{args.per_node}" for ns, addr in zip(NS, ADDR))
    argv = [sys.executable, "-m", "aiak.launch.advise", "--verify", "--steps", "12"]
    argv += ["--limit", str(args.limit), "-H", hosts, "--remote-shell", shell]
    argv += ["--rdzv-timeout", "120", "--", sys.executable, str(WORKER), "--models", args.advise]
    # the worker's timed steps follow its warm-up and checked steps; the probe measures 12 of
    # them after its 5 of warm-up, before the worker's optimizer-only steps
    argv += ["--steps", "30", "--warmup", "2", "--out", str(tmp / "advise-rows.json")]
    env = job_env(port)
    proc = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=3 * args.limit, check=False
    )
    text = proc.stdout + proc.stderr
    print(text, flush=True)
    if args.json:
        Path(args.json + ".advise.txt").write_text(text)
    return proc.returncode


def check(rows: list[dict]) -> None:
    """Tolerances: lossless modes 1e-5 (the sum's order differs), fp16 wires torch's fp16 hook's
    error on the same gradients (or 2e-3, whichever is larger); lossy compressors report only."""
    for r in rows:
        if r["mode"] in LOSSLESS:
            tol = 1e-5
        elif r["mode"].endswith("fp16"):
            tol = max(2e-3, 1.01 * r["rel_err_torch_fp16"])
        else:
            r["tol"], r["check"] = "", ""
            continue
        r["tol"], r["check"] = f"{tol:.1e}", "ok" if r["rel_err"] <= tol else "FAIL"


def overlap_hidden(rows: list[dict]) -> None:
    """``opt_hidden`` of each overlap row: the share of its base mode's optimizer time that
    leaves the step (1: all of it; > 1: the overlap also hid some communication)."""
    by = {(r["model"], r["mode"]): r for r in rows}
    for r in rows:
        base = by.get((r["model"], OVERLAP_BASE.get(r["mode"], "")))
        if base is None or not base.get("opt_ms"):
            continue
        r["opt_hidden"] = round((base["step_ms"] - r["step_ms"]) / base["opt_ms"], 3)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        ax.barh([r["mode"] for r in mine], [r["step_ms"] for r in mine], color="tab:blue")
        ax.invert_yaxis()
        ax.set(
            xlabel="DDP step (ms, median)", title=f"{model} ({mine[0]['grad_bytes'] / 1e6:.0f} MB)"
        )
        ax.grid(True, axis="x", alpha=0.3)
    r0 = rows[0]
    link = f"{r0['link_mbit']} Mbit/s tc" if r0["link_mbit"] else "veth, no tc limit"
    fig.suptitle(
        f"aiak.comm, {r0['nodes']} nodes x {r0['per_node']} {r0['device']}\nbetween nodes: "
        f"NCCL sockets over {link}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _png(nodes: int, per_node: int, rate: int) -> Path:
    link = f"_{rate}mbit" if rate else ""
    return RESULTS / f"comm_nodes_{nodes}x{per_node}{link}.png"


def latest_rows(nodes: int, per_node: int, rate: int) -> list[dict]:
    """Each (model, mode)'s latest row at this topology and link (a run split over several
    invocations plots whole; each bar's run is in the CSV by its timestamp)."""
    with (RESULTS / "comm_nodes.csv").open(newline="") as f:
        rows = [
            r
            for r in csv.DictReader(f)
            if (r["nodes"], r["per_node"], r["link_mbit"]) == (str(nodes), str(per_node), str(rate))
        ]
    if not rows:
        sys.exit(f"bench_comm_nodes: no {nodes} x {per_node} rows in comm_nodes.csv")
    # later rows replace earlier ones; modes this script no longer has are left out
    latest = {(r["model"], r["mode"]): r for r in rows if r["mode"] in MODES}
    rows = list(latest.values())
    for r in rows:
        r.update(step_ms=float(r["step_ms"]), grad_bytes=float(r["grad_bytes"]))
        r["link_mbit"] = int(r["link_mbit"])
    return rows


def write(rows: list[dict]) -> None:
    from _harness import append_csv  # imports torch: not needed by --replot

    append_csv("comm_nodes", [{k: r.get(k, "") for k in FIELDS} for r in rows])


def _devices() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, "CPU ranks (gloo)"
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


class Stopped(Exception):
    """SIGTERM (e.g. from ``timeout``): the namespaces go, the finished modes' rows stay."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(f"signal {signum}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-node", type=int, default=2, help="GPUs (ranks) per node")
    p.add_argument("--models", default="linear,resnet50")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rate", type=int, default=0, help="link Mbit/s (tc tbf); 0: no limit")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model and mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the checked one")
    p.add_argument("--limit", type=float, default=240, help="seconds per mode")
    p.add_argument("--csv", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--replot", action="store_true", help="plot each mode's latest CSV row, no runs")
    p.add_argument(
        "--trace",
        default="",
        help="folder: rank 0 profiles two more steps per model and mode, a chrome trace each "
        "(research/comm_trace_summary.py reads them)",
    )
    p.add_argument(
        "--advise", default="", help="run aiak-advise --verify on this model's plain DDP job, only"
    )
    args = p.parse_args()
    nodes = len(NS)
    if args.replot:
        plot(latest_rows(nodes, args.per_node, args.rate), _png(nodes, args.per_node, args.rate))
        return 0
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"bench_comm_nodes: unknown modes {unknown}; choose from {list(MODES)}")
    if args.per_node < 1:
        sys.exit("bench_comm_nodes: --per-node must be >= 1")
    if os.geteuid() != 0:
        sys.exit("bench_comm_nodes: needs root (ip netns, veth, tc)")
    bundle = Path(__file__).resolve().parents[1] / ".iproute2"  # scripts/iproute2-bundle
    if (bundle / "ip").exists():
        os.environ["PATH"] = f"{bundle}{os.pathsep}{os.environ.get('PATH', '')}"
    gpus, device = _devices()
    if gpus and gpus < nodes * args.per_node:
        sys.exit(
            f"bench_comm_nodes: {nodes} x {args.per_node} ranks need that many GPUs, {gpus} here"
        )
    from aiak.launch.flags import FLAGS

    unavailable = {f.option for f in FLAGS if not f.available}
    rows: list[dict] = []
    # A mode that fails is reported and the next one runs; a run stopped by SIGTERM or ^C
    # (a time limit) removes its namespaces and still reports the modes it finished.
    failed: list[str] = []
    stopped = ""
    signal.signal(signal.SIGTERM, _stop)
    with tempfile.TemporaryDirectory(prefix="aiak_nodes_") as tmp:
        shell = remote_shell(Path(tmp), args.per_node, gpus)
        try:
            setup_link(NS)
            if args.rate:
                set_rate(args.rate, NS)
            if args.advise:
                return run_advise(args, shell, Path(tmp), 29390)
            for i, mode in enumerate(modes):
                missing = sorted(unavailable & set(MODES[mode]))
                if missing:
                    print(f"{mode}: skipped, aiakrun {missing} not available in this version")
                    continue
                t = time.monotonic()
                try:
                    rows += run_mode(args, mode, shell, Path(tmp), 29400 + i)
                except RuntimeError as e:
                    print(e, file=sys.stderr, flush=True)
                    failed.append(mode)
                    continue
                print(f"{mode}: {time.monotonic() - t:.0f} s", flush=True)
        except (Stopped, KeyboardInterrupt) as e:
            stopped = str(e) or "interrupted"
        finally:
            kill_left(NS)
            teardown_link(NS)
    if stopped:
        done = list(dict.fromkeys(r["mode"] for r in rows))
        print(f"bench_comm_nodes: stopped ({stopped}); finished modes: {done}", flush=True)
    if failed:
        print(f"bench_comm_nodes: failed modes: {failed}", flush=True)
    if not rows:
        return 1
    check(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    flat = {r["model"]: r["step_ms"] for r in rows if r["mode"] == "flat"}
    for r in rows:
        r.update(
            timestamp=stamp,
            host=socket.gethostname(),
            device=device,
            nodes=nodes,
            per_node=args.per_node,
            link_mbit=args.rate,
        )
        r["vs_flat"] = round(flat[r["model"]] / r["step_ms"], 3) if r["model"] in flat else ""
    overlap_hidden(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    if args.csv:
        write(rows)
        try:
            plot(rows, _png(nodes, args.per_node, args.rate))
        except ImportError:
            print("matplotlib is missing: no plot (run again with --replot where it is installed)")
    skip = {"rel_err_torch_fp16", "grad_bytes", "tol", "intra_bytes_per_step"}
    cols = [c for c in FIELDS[FIELDS.index("model") :] if c not in skip]
    print("  ".join(f"{c:>18}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(
                f"{v:>18.4g}" if isinstance(v, float) else f"{'' if v is None else v!s:>18}"
            )
        print("  ".join(cells))
    return 1 if stopped or failed or any(r["check"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
