"""``aiakrun``: start a training command on one or many hosts with aiak's features switched on.

    aiakrun -np 8 --fp16-compression -- python train.py
    aiakrun -np 16 -H host1:8,host2:8 --hierarchical-allreduce -- python train.py
    aiakrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint head:29400 -- python train.py          # one per node, from a scheduler

One node: torch's elastic launcher (``torch.distributed.run``) runs in this process, with
torchrun's options passed through (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
``--rdzv-*``, ``--max-restarts``, ``--standalone``, ...). Several hosts (``-H``): aiakrun starts
itself on every host through a remote shell (``ssh`` by default, ``--remote-shell`` for another
prefix) as that host's node (``--node-rank`` in ``-H`` order: the first host holds rank 0).
The launched processes get the flags' variables, ``AIAK_AUTO=1`` and aiak's start-up hook on
PYTHONPATH: aiak activates itself when they import torch. Everything is checked before
anything starts (exit status 2); a failed worker ends the launch with torch's failure table
(rank, host, exit code or signal, the root cause's traceback) and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence

from aiak.launch import flags as _flags

__all__ = ["Host", "build_env", "check_env", "host_commands", "main", "parse_hosts"]

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
DEFAULT_PORT = 6666
DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes {host}"
FORWARD_PREFIXES = ("AIAK_", "PERSEUS_", "NCCL_", "GLOO_", "TORCH_", "OMP_")
# Per-process marks that must not leak from aiakrun's own environment into the workers.
SAID = "AIAK_LAUNCH_NOTICES_SAID"  # set for the hosts' nodes of an -H launch only
NOT_FORWARDED = ("AIAK_BOOTED_PID", SAID)
LOCAL_NAMES = ("localhost", "127.0.0.1")
# torchrun's options that make this launch one node of a job (a scheduler's per-node launch).
NODE_OPTIONS = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "master_port",
    "local_addr",
)


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


# ---- argument types: a bad value is argparse's error naming the option (exit status 2) ----


def _int_at_least(low: int) -> type:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse  # type: ignore[return-value]


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"a port number in 1..65535, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a finite number > 0, got {text!r}")
    return value


def _nnodes(text: str) -> str:
    parts = text.split(":")
    numbers = len(parts) in (1, 2) and all(p.isdigit() and int(p) >= 1 for p in parts)
    if numbers and (len(parts) == 1 or int(parts[0]) <= int(parts[1])):
        return text
    raise argparse.ArgumentTypeError(f"N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")


def _nproc(text: str) -> str:
    if text in ("auto", "cpu", "gpu", "xpu") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"an integer >= 1 or auto/cpu/gpu/xpu, got {text!r}")


def _endpoint(text: str) -> str:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and (not port.isdigit() or not 0 <= int(port) < 65536)):
        raise argparse.ArgumentTypeError(f"HOST or HOST:PORT, got {text!r}")
    return text


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _remote_shell(text: str) -> str:
    """A prefix with the one field ``{host}`` (``ssh {hots}`` would be a KeyError later)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (e.g. 'ssh -o BatchMode=yes {host}')")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {e}") from None
    unknown = sorted({f for f in fields if f != "host"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown field {{{unknown[0]}}} in {text!r}: the one field is {{host}}"
        )
    if not fields:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no {{host}}: the host to run on goes where {{host}} stands"
        )
    try:
        shlex.split(text.format(host="h"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into words: {e}") from None
    return text


def _version() -> str:
    from importlib import metadata

    try:
        aiak = metadata.version("aiak")
    except metadata.PackageNotFoundError:
        aiak = "unknown (not installed)"
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return f"aiak {aiak} (torch {torch}, python {sys.version.split()[0]})"


def _parser(prog: str = "aiakrun") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Launch training on one or many hosts with aiak's features on.",
        usage=f"{prog} [-np N] [-H host:n,...] [torchrun options] [features] [--] COMMAND [ARG...]",
        epilog="A COMMAND starting with a .py file runs under --python, as torchrun does.",
    )
    p.add_argument("--version", action="version", version=_version())
    p.add_argument(
        "-np", "--num-proc", dest="np", type=_int_at_least(1), help="number of processes"
    )
    p.add_argument("-H", "--hosts", help="host[=addr][:slots],... (default localhost:NP)")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--gloo", action="store_true", help="gloo backend")
    backend.add_argument("--nccl", action="store_true", help="NCCL backend (default with GPUs)")
    p.add_argument(
        "--master-addr", type=_nonempty, help="rendezvous address (default: the first host's)"
    )
    p.add_argument(
        "--remote-shell",
        type=_remote_shell,
        default=DEFAULT_REMOTE_SHELL,
        help="prefix that runs a shell command on {host}; the command is its last argument "
        f"(default {DEFAULT_REMOTE_SHELL!r}; e.g. 'ip netns exec {{host}} sh -c')",
    )
    p.add_argument("--python", type=_nonempty, default=sys.executable, help="python on the hosts")
    p.add_argument(
        "--rdzv-timeout", type=_int_at_least(1), default=300, help="seconds to wait for hosts"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument(
        "--advise",
        action="store_true",
        help="measure the command's steps and say which aiak features to switch on "
        "(the same as aiak-advise; see aiak-advise --help for its own options)",
    )
    t = p.add_argument_group("torchrun's options (passed to torch's elastic launcher)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, help="processes per node")
    t.add_argument("--nnodes", type=_nnodes, help="N or MIN:MAX nodes (one launch per node)")
    t.add_argument("--node-rank", "--node_rank", type=_int_at_least(0), help="this node's rank")
    t.add_argument("--rdzv-backend", "--rdzv_backend", type=_nonempty, help="c10d, static, ...")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", type=_endpoint, help="HOST[:PORT]")
    t.add_argument("--rdzv-id", "--rdzv_id", type=_nonempty, help="the job's id")
    t.add_argument("--rdzv-conf", "--rdzv_conf", type=_nonempty, help="key=value,...")
    t.add_argument("--standalone", action="store_true", help="one node, a local rendezvous")
    t.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=_int_at_least(0),
        default=0,
        help="restarts of the whole worker group after a failure (default 0)",
    )
    t.add_argument("--monitor-interval", "--monitor_interval", type=_positive_float, help="seconds")
    t.add_argument("--master-port", "--master_port", type=_port, help="static rendezvous port")
    t.add_argument("--local-addr", "--local_addr", type=_nonempty, help="this node's address")
    _flags.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Options, then the command: after ``--``, or from the first word that is no option."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        args = parser.parse_args(argv[:i])
        if args.command:
            parser.error(f"unrecognized arguments before '--': {shlex.join(args.command)}")
        args.command = argv[i + 1 :]
    else:
        args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command to run (aiakrun -np 2 -- python train.py)")
    return args


def _default_backend() -> str:
    import torch  # the launcher itself needs torch; aiak's subpackages stay unimported

    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_nccl() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise ValueError(
            "aiakrun: --nccl: this torch is built without NCCL (a CPU build?); use --gloo, or "
            "install a CUDA build of torch"
        )


def build_env(
    feature_env: Mapping[str, str], backend: str, base: Mapping[str, str]
) -> dict[str, str]:
    """The variables every launched process gets on top of its host's environment."""
    env = {
        k: v for k, v in base.items() if k.startswith(FORWARD_PREFIXES) and k not in NOT_FORWARDED
    }
    env.update(feature_env)
    env["AIAK_AUTO"] = "1"
    env["AIAK_BACKEND"] = backend
    for src, dst in (
        ("PERSEUS_NCCL_NETWORK_INTERFACE", "NCCL_SOCKET_IFNAME"),
        ("PERSEUS_GLOO_NETWORK_INTERFACE", "GLOO_SOCKET_IFNAME"),
    ):
        if env.get(src):
            env[dst] = env[src]
    path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *path])
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


def _is_python(program: str) -> bool:
    return re.fullmatch(r"python[\d.]*", os.path.basename(program)) is not None


def resolve_command(command: Sequence[str], python: str) -> list[str]:
    """A ``.py`` first word runs under ``python`` (torchrun's rule); the program must exist."""
    command = list(command)
    if command[0].endswith(".py"):
        command.insert(0, python)
    program = command[0]
    if shutil.which(program) is None:
        if os.sep in program:
            why = "is not executable" if os.path.exists(program) else "does not exist"
        else:
            why = "is not on PATH"
        raise ValueError(f"aiakrun: cannot run {program!r}: it {why}")
    return command


def check_python(command: Sequence[str], env: Mapping[str, str], timeout: float = 60.0) -> None:
    """A python other than this one must import aiak, or its processes would run without
    aiak's features (its start-up hook stops them)."""
    program = shutil.which(command[0]) or command[0]
    if not _is_python(program):
        return
    if os.path.realpath(program) == os.path.realpath(sys.executable):
        return
    quiet = {k: v for k, v in env.items() if k != "AIAK_AUTO"}
    try:
        out = subprocess.run(
            [program, "-c", "import aiak.launch._boot"],
            env=quiet,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"aiakrun: {program} did not start within {timeout:g} s") from None
    if out.returncode != 0:
        raise ValueError(
            f"aiakrun: {program} (the command's python) cannot import aiak, which is installed "
            f"for {sys.executable}: name that python after '--' (or install aiak for {program})"
        )


def _conf(conf: str | None, key: str, value: object) -> str:
    """``--rdzv-conf`` with ``key=value`` added unless the user's conf sets the key."""
    items = [c for c in (conf or "").split(",") if c]
    if not any(c.split("=", 1)[0].strip() == key for c in items):
        items.append(f"{key}={value}")
    return ",".join(items)


def torchrun_args(args: argparse.Namespace, nproc: str, port: int | None = None) -> list[str]:
    """torch.distributed.run's arguments for this node (before ``--no-python COMMAND``).

    With none of torchrun's node options, one node with a c10d rendezvous on 127.0.0.1 (a free
    port, or ``port``); otherwise torchrun's options as given, torchrun's defaults for the rest.
    """
    out = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}"]
    if args.monitor_interval is not None:
        out.append(f"--monitor-interval={args.monitor_interval}")
    given = [n for n in NODE_OPTIONS if getattr(args, n) not in (None, False)]
    if not given:
        endpoint_port = args.master_port or port or _free_port()
        conf = _conf(args.rdzv_conf, "join_timeout", args.rdzv_timeout)
        return [
            *out,
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{endpoint_port}",
            f"--rdzv-id={uuid.uuid4().hex[:12]}",
            f"--rdzv-conf={conf}",
        ]
    if args.standalone:
        out.append("--standalone")
    for name in ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
        value = getattr(args, name)
        if value is not None:
            out.append(f"--{name.replace('_', '-')}={value}")
    backend = args.rdzv_backend or "static"
    key = "timeout" if backend == "static" else "join_timeout"
    if not args.standalone:
        out.append(f"--rdzv-conf={_conf(args.rdzv_conf, key, args.rdzv_timeout)}")
    for name in ("master_addr", "master_port", "local_addr"):
        value = getattr(args, name)
        if value is not None:
            out.append(f"--{name.replace('_', '-')}={value}")
    return out


def _node_count(nnodes: str | None) -> int:
    return int((nnodes or "1").split(":")[-1])


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
    backend: str = "gloo",
    max_restarts: int = 0,
) -> list[tuple[Host, list[str]]]:
    """Per host, the argv that starts aiakrun there as that host's node (the remote shell's
    prefix, then one shell line). Without restarts the rendezvous is torch's static one with
    ``--node-rank`` in ``-H`` order, so the first host holds rank 0; with ``max_restarts`` it is
    c10d (torch orders its nodes by address then), served by the first host."""
    cwd = cwd or os.getcwd()
    out = []
    for i, h in enumerate(hosts):
        launcher = [python, "-m", "aiak.launch.run", f"--{backend}"]
        launcher += [f"--nnodes={len(hosts)}", f"--nproc-per-node={h.slots}"]
        launcher += [f"--max-restarts={max_restarts}", f"--rdzv-timeout={timeout}"]
        if max_restarts:
            launcher += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={master_addr}:{port}",
                f"--rdzv-conf=is_host={int(i == 0)}",
            ]
        else:
            launcher += [
                "--rdzv-backend=static",
                f"--node-rank={i}",
                f"--master-addr={master_addr}",
                f"--master-port={port}",
            ]
        launcher += [f"--rdzv-id={run_id}", f"--local-addr={h.addr}", "--"]
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


def _run_node(torch_args: list[str], command: list[str], env: Mapping[str, str]) -> int:
    """torch's elastic launcher in this process; torchrun's convention on failure: its table
    of failures (rank, host, exit code or signal, root cause's traceback) and exit status 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    os.environ.update(env)  # the workers inherit this process's environment
    for name in NOT_FORWARDED:
        os.environ.pop(name, None)
    try:
        torchrun(parse_args([*torch_args, "--no-python", *command]))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    except Exception as e:  # rendezvous timeouts and the like: named, without a traceback
        print(f"aiakrun: the launch failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
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
                text = ", ".join(
                    f"{name} (exit {c})" if c > 0 else f"{name} ({signal.Signals(-c).name})"
                    for name, c in failed
                )
                print(f"aiakrun: host(s) failed: {text}; stopping the others", file=sys.stderr)
                _stop(procs)
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _warnings(env: Mapping[str, str], nodes: int) -> list[str]:
    """Settings that would change nothing for an unchanged script, said once, at start-up."""
    from aiak.comm.auto import notices

    return notices(env, nodes)


def main(argv: Sequence[str] | None = None, prog: str = "aiakrun") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--site-dir"]:  # for PYTHONPATH where no aiak-auto.pth is installed
        print(SITE_DIR)
        return 0
    # aiakrun started under AIAK_AUTO=1 (or as a host's node) must not activate itself
    from aiak.launch import _boot

    _boot._remove_finder()
    head = argv[: argv.index("--")] if "--" in argv else argv
    if "--advise" in head:  # the same job, measured by aiak-advise (which starts aiakrun)
        from aiak.launch import advise

        argv.remove("--advise")
        return advise.main(argv)
    parser = _parser(prog)
    try:
        args = _parse(parser, argv)
    except SystemExit as e:  # -h, --version (0) or argparse's error naming the option (2)
        return int(e.code or 0)
    try:
        return _launch(args)
    except ValueError as e:
        text = str(e)
        print(text if text.startswith("aiakrun") else f"aiakrun: error: {text}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    features = _flags.environment(args)
    for line in _flags.deprecations(args):
        print(f"aiakrun: warning: {line}", file=sys.stderr)
    node_given = [n for n in NODE_OPTIONS if getattr(args, n) not in (None, False)]
    hosts_given = bool(args.hosts)
    if hosts_given and node_given:
        raise ValueError(
            "aiakrun: -H starts every host itself; "
            + ", ".join("--" + n.replace("_", "-") for n in node_given)
            + " belong to one launch per node (a scheduler's): give one or the other"
        )
    if args.nccl:
        _check_nccl()
    backend = "gloo" if args.gloo else "nccl" if args.nccl else _default_backend()
    env = build_env(features, backend, os.environ)
    check_env({**os.environ, **env})
    command = list(args.command)
    if hosts_given:
        hosts = parse_hosts(args.hosts, args.np)
        if args.nproc_per_node is not None:
            raise ValueError("aiakrun: with -H, each host's slots are its processes")
        if len(hosts) > 1 or hosts[0].name not in LOCAL_NAMES:
            return _launch_hosts(args, hosts, command, env, backend)
        nproc = str(hosts[0].slots)
    else:
        nproc = _nproc_of(args)
    command = resolve_command(command, args.python)
    if not os.environ.get(SAID):  # a host's node of an -H launch: said on the first machine
        for line in _warnings({**os.environ, **env}, _node_count(args.nnodes)):
            print(f"aiakrun: warning: {line}", file=sys.stderr)
    port = os.environ.get("PERSEUS_MASTER_PORT")
    torch_args = torchrun_args(args, nproc, int(port) if port else None)
    if args.dry_run:
        for k, v in sorted(env.items()):
            print(f"export {k}={shlex.quote(v)}")
        print(shlex.join([args.python, "-m", "torch.distributed.run", *torch_args,
                          "--no-python", *command]))  # fmt: skip
        return 0
    check_python(command, {**os.environ, **env})
    return _run_node(torch_args, command, env)


def _nproc_of(args: argparse.Namespace) -> str:
    both = args.np is not None and args.nproc_per_node is not None
    if both and str(args.np) != args.nproc_per_node:
        raise ValueError(
            f"aiakrun: -np {args.np} and --nproc-per-node {args.nproc_per_node} disagree (give one)"
        )
    if args.np is not None and _node_count(args.nnodes) > 1:
        raise ValueError(
            "aiakrun: -np counts the processes of all -H hosts; with --nnodes, give each "
            "node's count as --nproc-per-node"
        )
    if args.np is None and args.nproc_per_node is None:
        raise ValueError("aiakrun: give -np N or --nproc-per-node N")
    return args.nproc_per_node or str(args.np)


def _launch_hosts(
    args: argparse.Namespace,
    hosts: list[Host],
    command: list[str],
    env: Mapping[str, str],
    backend: str,
) -> int:
    for line in _warnings({**os.environ, **env}, len(hosts)):
        print(f"aiakrun: warning: {line}", file=sys.stderr)
    port = int(os.environ.get("PERSEUS_MASTER_PORT") or DEFAULT_PORT)
    master = args.master_addr or hosts[0].addr
    cmds = host_commands(
        hosts,
        command,
        {**env, SAID: "1"},
        args.remote_shell,
        args.python,
        master,
        port,
        uuid.uuid4().hex[:12],
        args.rdzv_timeout,
        backend=backend,
        max_restarts=args.max_restarts,
    )
    if args.dry_run:
        for h, cmd in cmds:
            print(f"# {h.name} ({h.slots} processes)")
            print(shlex.join(cmd))
        return 0
    return _run_multi(cmds)


def perseusrun() -> int:
    """``perseusrun``: the same launcher under Perseus's name (its flags and variables)."""
    return main(prog="perseusrun")


if __name__ == "__main__":
    raise SystemExit(main())
