"""``aiakrun``: start a training command on one or many hosts with aiak's features switched on.

    aiakrun -np 8 --fp16-compression -- python train.py
    aiakrun -np 16 -H host1:8,host2:8 --hierarchical-allreduce -- python train.py

One host: torch's elastic launcher (``torch.distributed.run``) runs in this process. Several
hosts: the same launcher is started on every host through a remote shell (``ssh`` by default,
``--remote-shell`` for another prefix), with a c10d rendezvous on the first host
(``PERSEUS_MASTER_PORT``, default 6666). The launched processes get the flags' variables,
``AIAK_AUTO=1`` and aiak's start-up hook on PYTHONPATH: aiak activates itself when they import
torch. The flags and variables are checked before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence

from aiak.launch import flags as _flags

__all__ = ["Host", "build_env", "host_commands", "main", "parse_hosts"]

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
DEFAULT_PORT = 6666
DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes {host}"
FORWARD_PREFIXES = ("AIAK_", "PERSEUS_", "NCCL_", "GLOO_", "TORCH_", "OMP_")
LOCAL_NAMES = ("localhost", "127.0.0.1")


@dataclasses.dataclass(frozen=True)
class Host:
    name: str  # what the remote shell is given
    addr: str  # the address other hosts reach it at
    slots: int


_HOST = re.compile(r"^(?P<name>[^=:,\s]+)(=(?P<addr>[^:,\s]+))?(:(?P<slots>\d+))?$")


def parse_hosts(spec: str | None, np: int | None) -> list[Host]:
    """``-H name[=addr][:slots],...`` and ``-np`` -> hosts with their process counts."""
    if np is not None and np < 1:
        raise ValueError(f"aiakrun: -np must be >= 1, got {np}")
    if not spec:
        if np is None:
            raise ValueError("aiakrun: give -np N (and -H host:n,... for several hosts)")
        return [Host("localhost", "127.0.0.1", np)]
    hosts = []
    for token in spec.split(","):
        m = _HOST.match(token.strip())
        if m is None:
            raise ValueError(f"aiakrun: -H: cannot read {token!r} (expected name[=addr][:slots])")
        slots = int(m["slots"]) if m["slots"] else 1
        if slots < 1:
            raise ValueError(f"aiakrun: -H: {token!r} has no slots")
        name = m["name"]
        hosts.append(Host(name, m["addr"] or name, slots))
    if len({h.name for h in hosts}) != len(hosts):
        raise ValueError(f"aiakrun: -H names a host twice: {spec!r}")
    total = sum(h.slots for h in hosts)
    if np is None:
        return hosts
    if np > total:
        raise ValueError(f"aiakrun: -np {np} is more than the {total} slots of -H {spec}")
    out, left = [], np
    for h in hosts:  # fill hosts in order, as horovodrun does
        if left == 0:
            break
        n = min(left, h.slots)
        out.append(Host(h.name, h.addr, n))
        left -= n
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiakrun",
        description="Launch training on one or many hosts with aiak's features on.",
        usage="aiakrun [-np N] [-H host:n,...] [options] -- COMMAND [ARG...]",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of processes")
    p.add_argument("-H", "--hosts", help="host[=addr][:slots],... (default localhost:NP)")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--gloo", action="store_true", help="gloo backend")
    backend.add_argument("--nccl", action="store_true", help="NCCL backend (default with GPUs)")
    p.add_argument("--master-addr", help="rendezvous address (default: the first host's)")
    p.add_argument(
        "--remote-shell",
        default=DEFAULT_REMOTE_SHELL,
        help="prefix that runs a shell command on {host}; the command is its last argument "
        f"(default {DEFAULT_REMOTE_SHELL!r}; e.g. 'ip netns exec {{host}} sh -c')",
    )
    p.add_argument("--python", default=sys.executable, help="python on the hosts")
    p.add_argument("--rdzv-timeout", type=int, default=300, help="seconds to wait for hosts")
    p.add_argument("--dry-run", action="store_true", help="print the per-host commands only")
    _flags.add_arguments(p)
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise ValueError("aiakrun: put the command after '--' (aiakrun -np 2 -- python train.py)")
    i = argv.index("--")
    command = argv[i + 1 :]
    if not command:
        raise ValueError("aiakrun: no command after '--'")
    return argv[:i], command


def _default_backend() -> str:
    import torch  # the launcher itself needs torch; aiak's subpackages stay unimported

    return "nccl" if torch.cuda.is_available() else "gloo"


def build_env(
    feature_env: Mapping[str, str], backend: str, base: Mapping[str, str]
) -> dict[str, str]:
    """The variables every launched process gets on top of its host's environment."""
    env = {k: v for k, v in base.items() if k.startswith(FORWARD_PREFIXES)}
    env.update(feature_env)
    env["AIAK_AUTO"] = "1"
    env["AIAK_BACKEND"] = backend
    for src, dst in (
        ("PERSEUS_NCCL_NETWORK_INTERFACE", "NCCL_SOCKET_IFNAME"),
        ("PERSEUS_GLOO_NETWORK_INTERFACE", "GLOO_SOCKET_IFNAME"),
    ):
        if env.get(src):
            env[dst] = env[src]
    path = base.get("PYTHONPATH", "")
    env["PYTHONPATH"] = SITE_DIR + (os.pathsep + path if path else "")
    return env


def check_env(env: Mapping[str, str]) -> None:
    """Every subpackage checks its own variables, here, before anything starts (lazily)."""
    import importlib

    for name in ("aiak.comm.auto", "aiak.optim.auto"):
        mod = importlib.import_module(name)
        check = getattr(mod, "check", None)
        if check is not None:
            check(env)
    port = env.get("PERSEUS_MASTER_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"PERSEUS_MASTER_PORT must be a port number, got {port!r}")


def _torchrun_args(
    nnodes: int,
    nproc: int,
    endpoint: str,
    run_id: str,
    timeout: int,
    local_addr: str | None,
    is_host: bool | None = None,
) -> list[str]:
    conf = f"join_timeout={timeout}"
    if is_host is not None:  # who serves the rendezvous store: the first host, said explicitly
        conf += f",is_host={int(is_host)}"  # (torch guesses it from the host name otherwise)
    args = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
    ]
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    return [*args, "--no-python"]


def host_commands(
    hosts: Sequence[Host],
    command: Sequence[str],
    env: Mapping[str, str],
    remote_shell: str,
    python: str,
    master_addr: str,
    port: int,
    run_id: str,
    timeout: int = 300,
    cwd: str | None = None,
) -> list[tuple[Host, list[str]]]:
    """Per host, the argv that starts torch's launcher there (through the remote shell)."""
    cwd = cwd or os.getcwd()
    out = []
    for i, h in enumerate(hosts):
        launcher = [python, "-m", "torch.distributed.run"]
        launcher += _torchrun_args(
            len(hosts), h.slots, f"{master_addr}:{port}", run_id, timeout, h.addr, i == 0
        )
        assignments = [f"{k}={v}" for k, v in sorted(env.items())]
        line = " ".join(
            [
                "cd",
                shlex.quote(cwd),
                "&&",
                "exec",
                "env",
                *map(shlex.quote, assignments),
                *map(shlex.quote, launcher),
                *map(shlex.quote, command),
            ]
        )
        if h.name in LOCAL_NAMES:
            argv = ["sh", "-c", line]
        else:
            argv = [*shlex.split(remote_shell.format(host=h.name)), line]
        out.append((h, argv))
    return out


def _run_single(np: int, command: list[str], env: Mapping[str, str], timeout: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.update(env)  # the workers inherit this process's environment
    port = os.environ.get("PERSEUS_MASTER_PORT") or str(_free_port())
    args = _torchrun_args(1, np, f"127.0.0.1:{port}", uuid.uuid4().hex[:12], timeout, None)
    try:
        torchrun([*args, *command])
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        print(f"aiakrun: {len(codes)} process(es) failed (exit {codes})", file=sys.stderr)
        return next((c for c in codes if c), 1) if codes else 1
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _run_multi(cmds: Sequence[tuple[Host, list[str]]]) -> int:
    procs = [subprocess.Popen(argv, start_new_session=True) for _, argv in cmds]

    def on_signal(signum: int, frame: object) -> None:
        _stop(procs)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(h.name, c) for (h, _), c in zip(cmds, codes) if c not in (None, 0)]
            if failed:
                print(f"aiakrun: host(s) failed: {failed}; stopping the others", file=sys.stderr)
                _stop(procs)
                return failed[0][1] if failed[0][1] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--site-dir"]:  # for PYTHONPATH where no aiak-auto.pth is installed
        print(SITE_DIR)
        return 0
    parser = _parser()
    try:
        own, command = _split(argv)
        args = parser.parse_args(own)
        features = _flags.environment(args)
        hosts = parse_hosts(args.hosts, args.np)
        backend = "gloo" if args.gloo else "nccl" if args.nccl else _default_backend()
        env = build_env(features, backend, os.environ)
        check_env({**os.environ, **env})
    except ValueError as e:
        print(
            f"aiakrun: error: {e}" if not str(e).startswith("aiakrun") else str(e), file=sys.stderr
        )
        return 2
    port = int(os.environ.get("PERSEUS_MASTER_PORT") or DEFAULT_PORT)
    if len(hosts) == 1 and hosts[0].name in LOCAL_NAMES:
        if args.dry_run:
            for k, v in sorted(env.items()):
                print(f"export {k}={shlex.quote(v)}")
            print(
                shlex.join(
                    [
                        args.python,
                        "-m",
                        "torch.distributed.run",
                        f"--nproc-per-node={hosts[0].slots}",
                        "--no-python",
                        *command,
                    ]
                )
            )
            return 0
        return _run_single(hosts[0].slots, command, env, args.rdzv_timeout)
    master = args.master_addr or hosts[0].addr
    run_id = uuid.uuid4().hex[:12]
    cmds = host_commands(
        hosts, command, env, args.remote_shell, args.python, master, port, run_id, args.rdzv_timeout
    )
    if args.dry_run:
        for h, cmd in cmds:
            print(f"# {h.name} ({h.slots} processes)")
            print(shlex.join(cmd))
        return 0
    return _run_multi(cmds)


if __name__ == "__main__":
    raise SystemExit(main())
