"""``aiak-doctor``: checks of the machine and of the AIAK_/PERSEUS_ variables, each with a
verdict (ok / warn / fail / info) and a fix. ``--json`` prints the same rows for machines.
``-H host:n,...`` adds whether each host resolves and answers, and whether the rendezvous port
(``PERSEUS_MASTER_PORT``, default 6666) on the first host can be reached or, locally, bound.

The exit status is 1 when a check fails, else 0. The variable checks call each subpackage's
own ``check`` (lazily: the doctor is not imported by anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Check", "main", "run_checks"]


@dataclasses.dataclass
class Check:
    name: str
    verdict: str  # "ok", "warn", "fail" or "info"
    detail: str
    fix: str = ""


def _cmd(argv: Sequence[str], timeout: float = 20.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def check_gpus() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [
            Check(
                "GPUs",
                "info",
                f"no CUDA GPU visible to torch {torch.__version__} (CPU: gloo only)",
                "on a GPU machine: a CUDA build of torch and the NVIDIA driver",
            )
        ]
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    rows = [Check("GPUs", "ok", f"{n} x {', '.join(names)}; CUDA {torch.version.cuda}")]
    topo = _cmd(["nvidia-smi", "topo", "-m"])
    if topo is None:
        rows.append(
            Check("GPU topology", "warn", "nvidia-smi topo -m unavailable", "install nvidia-smi")
        )
    else:
        lines = [ln for ln in topo.splitlines() if ln.startswith("GPU")]
        kinds = ("PIX", "PXB", "PHB", "NODE", "SYS")
        links = sorted(
            {c for ln in lines for c in ln.split() if c in kinds or re.fullmatch(r"NV\d+", c)}
        )
        slow = [c for c in links if c in ("SYS", "NODE", "PHB")]
        rows.append(
            Check(
                "GPU topology",
                "warn" if slow and not any(c.startswith("NV") for c in links) else "ok",
                "links: " + (", ".join(links) or "single GPU"),
                "GPU pairs over SYS/NODE/PHB cross the CPU: --hierarchical-allreduce helps"
                if slow
                else "",
            )
        )
    return rows


def check_nccl() -> list[Check]:
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return [Check("NCCL", "info", "this torch has no NCCL", "gloo only (aiakrun --gloo)")]
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # a torch without CUDA reports it here
        return [Check("NCCL", "info", f"unavailable: {e}", "")]
    text = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return [Check("NCCL", "ok", f"version {text}")]


def _modules() -> set[str]:
    try:
        with open("/proc/modules") as f:
            return {ln.split()[0] for ln in f if ln.strip()}
    except OSError:
        out = _cmd(["lsmod"]) or ""
        return {ln.split()[0] for ln in out.splitlines()[1:] if ln.strip()}


def check_rdma(env: Mapping[str, str]) -> list[Check]:
    rows = []
    ib = (
        sorted(os.listdir("/sys/class/infiniband"))
        if os.path.isdir("/sys/class/infiniband")
        else []
    )
    hca = env.get("NCCL_IB_HCA")
    if not ib:
        rows.append(
            Check(
                "RDMA devices",
                "info",
                "none in /sys/class/infiniband",
                "multi-host jobs use TCP sockets (NCCL_SOCKET_IFNAME)",
            )
        )
    else:
        rows.append(Check("RDMA devices", "ok", ", ".join(ib)))
    if hca:
        wanted = [h.split(":")[0].lstrip("^=") for h in hca.split(",") if h]
        unknown = [h for h in wanted if ib and not any(d.startswith(h) for d in ib)]
        rows.append(
            Check(
                "NCCL_IB_HCA",
                "fail" if unknown or not ib else "ok",
                f"{hca}" + (f" (not present: {unknown or wanted})" if unknown or not ib else ""),
                f"set NCCL_IB_HCA to devices of /sys/class/infiniband: {ib}"
                if unknown or not ib
                else "",
            )
        )
    gdr = env.get("NCCL_NET_GDR_LEVEL")
    mods = _modules()
    peermem = bool({"nvidia_peermem", "nv_peer_mem"} & mods)
    if ib:
        rows.append(
            Check(
                "GPUDirect RDMA",
                "ok" if peermem else "warn",
                "nvidia_peermem loaded" if peermem else "nvidia_peermem not loaded",
                "" if peermem else "modprobe nvidia_peermem (GPU memory straight to the NIC)",
            )
        )
    if gdr is not None:
        levels = ("LOC", "PIX", "PXB", "PHB", "SYS")
        if not (gdr.upper() in levels or gdr.isdigit()):
            rows.append(
                Check(
                    "NCCL_NET_GDR_LEVEL",
                    "fail",
                    f"{gdr!r} is not a level NCCL knows",
                    f"one of {', '.join(levels)} or a number (0-5)",
                )
            )
        elif ib and not peermem:
            rows.append(
                Check(
                    "NCCL_NET_GDR_LEVEL",
                    "warn",
                    f"{gdr} (nvidia_peermem not loaded: GPUDirect RDMA cannot engage)",
                    "modprobe nvidia_peermem",
                )
            )
        else:
            rows.append(Check("NCCL_NET_GDR_LEVEL", "ok", gdr))
    return rows


def check_nics(env: Mapping[str, str]) -> list[Check]:
    try:
        nics = sorted(os.listdir("/sys/class/net"))
    except OSError:
        nics = []
    rows = [Check("network interfaces", "info", ", ".join(nics) or "none found")]
    for var in (
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "PERSEUS_NCCL_NETWORK_INTERFACE",
        "PERSEUS_GLOO_NETWORK_INTERFACE",
    ):
        value = env.get(var)
        if not value:
            continue
        # NCCL's syntax: a prefix list, "^" excludes, "=" matches exactly.
        names = [v for v in value.split(",") if v]
        if names and names[0].startswith("^"):
            rows.append(Check(var, "ok", f"{value} (an exclusion list)"))
            continue
        missing = [
            n
            for n in names
            if not any((x == n.lstrip("=")) if n.startswith("=") else x.startswith(n) for x in nics)
        ]
        rows.append(
            Check(
                var,
                "fail" if missing else "ok",
                value + (f" (no such interface: {missing})" if missing else ""),
                f"choose among {nics}" if missing else "",
            )
        )
    return rows


# Variables of aiak read outside comm's and optim's checks: name -> (accepted values, reader)
_OPS_CHOICES = {
    "AIAK_DISABLE_KERNELS": (("0", "1"), "aiak.ops"),
    "AIAK_NATIVE_HOST": (("0", "1"), "aiak.ops"),
}
TIMEOUTS = ("GLOO_TIMEOUT_SECONDS", "AIAK_NCCL_TIMEOUT_SECONDS")


def _ops_choices() -> dict[str, tuple[tuple[str, ...], str]]:
    choices = dict(_OPS_CHOICES)
    try:  # the ops module names its own variable and values
        from aiak.ops import _window_attention_cuda as wa

        choices[wa.KERNEL_ENV] = (tuple(wa.KERNEL_CHOICES), "aiak.ops window attention")
        from aiak.ops import _window_attention_kernels as wak

        for env, variants in ((wak.BWD_VARIANT_ENV, wak.BWD_VARIANTS),
                              (wak.FWD_VARIANT_ENV, wak.FWD_VARIANTS)):  # fmt: skip
            choices[env] = (tuple(variants), "aiak.ops window attention")
    except ImportError:
        pass
    return choices


def check_variables(env: Mapping[str, str]) -> list[Check]:
    ours = sorted(k for k in env if k.startswith(("AIAK_", "PERSEUS_")) or k in TIMEOUTS)
    if not ours:
        return [Check("AIAK_/PERSEUS_ variables", "info", "none set")]
    rows = []
    for name, (values, reader) in _ops_choices().items():
        raw = env.get(name)
        if raw is not None and raw.strip() not in values:
            rows.append(
                Check(name, "fail", f"{raw!r} ({reader} refuses it)", f"one of {', '.join(values)}")
            )
    for name in ("aiak.comm.auto", "aiak.optim.auto"):
        try:
            importlib.import_module(name).check(env)
        except (ValueError, NotImplementedError) as e:
            rows.append(
                Check(
                    f"variables ({name.split('.')[1]})",
                    "fail",
                    str(e),
                    "fix or unset the variable named",
                )
            )
        else:
            rows.append(Check(f"variables ({name.split('.')[1]})", "ok", "valid"))
    auto = env.get("AIAK_AUTO")
    if auto is not None and auto not in ("0", "1"):
        rows.append(Check("AIAK_AUTO", "fail", repr(auto), "0 or 1"))
    rows.append(Check("set", "info", " ".join(f"{k}={env[k]}" for k in ours)))
    return rows


def check_install() -> list[Check]:
    """aiak's version, and whether ``AIAK_AUTO=1`` activates aiak outside aiakrun here."""
    from importlib import metadata

    try:
        version = metadata.version("aiak")
    except metadata.PackageNotFoundError:
        return [
            Check("aiak", "warn", "not installed (imported from a source tree)", "pip install .")
        ]
    rows = [
        Check("aiak", "ok", f"version {version} at {os.path.dirname(os.path.dirname(__file__))}")
    ]
    from aiak.launch.run import SITE_DIR

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    pth = [f for f in folders if os.path.isfile(os.path.join(f, "aiak-auto.pth"))]
    on_path = SITE_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if pth or on_path:
        where = f"aiak-auto.pth in {pth[0]}" if pth else "aiakrun's start-up folder on PYTHONPATH"
        rows.append(Check("activation (AIAK_AUTO=1)", "ok", f"works here ({where})"))
    else:
        rows.append(
            Check(
                "activation (AIAK_AUTO=1)",
                "warn",
                "only under aiakrun: this install has no aiak-auto.pth (an editable install), "
                "so AIAK_AUTO=1 with torchrun or python does nothing",
                f"PYTHONPATH={SITE_DIR} (aiakrun --site-dir), or pip install . (not -e)",
            )
        )
    return rows


def _connect(host: str, port: int, timeout: float) -> str:
    """``"open"``, ``"refused"`` (the host answers, nothing listens) or ``"silent"``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def check_hosts(spec: str, port: int, timeout: float = 3.0) -> list[Check]:
    """aiakrun's ``-H``: each host resolves and answers (its ssh port), and the rendezvous port
    of the first host is free: bindable when the first host is this machine, else refused
    (reachable, nothing listening yet) rather than silent (a firewall)."""
    from aiak.launch.run import LOCAL_NAMES, parse_hosts

    try:
        hosts = parse_hosts(spec, None)
    except ValueError as e:
        return [Check("-H", "fail", str(e), "name[=addr][:slots],...")]
    rows = []
    for h in hosts:
        try:
            addr = socket.getaddrinfo(h.addr, None)[0][4][0]
        except OSError as e:
            rows.append(Check(f"host {h.name}", "fail", f"{h.addr} does not resolve: {e}", ""))
            continue
        if h.name in LOCAL_NAMES:
            rows.append(Check(f"host {h.name}", "ok", f"{addr} (this machine, no remote shell)"))
            continue
        state = _connect(addr, 22, timeout)
        said = {"open": "answers", "refused": "refused", "silent": f"silent for {timeout:g} s"}
        fix = "aiakrun's default remote shell is ssh; --remote-shell for another"
        rows.append(
            Check(
                f"host {h.name}",
                "ok" if state == "open" else "warn",
                f"{addr}: ssh port {said[state]}",
                "" if state == "open" else fix,
            )
        )
    first = hosts[0]
    if first.name in LOCAL_NAMES:
        try:
            with socket.socket() as s:
                s.bind(("", port))
            rows.append(Check(f"rendezvous port {port}", "ok", "free on this machine"))
        except OSError as e:
            rows.append(
                Check(f"rendezvous port {port}", "fail", f"cannot bind: {e}", "PERSEUS_MASTER_PORT")
            )
        return rows
    state = _connect(first.addr, port, timeout)
    verdict, detail = {
        "refused": ("ok", "reachable (nothing listens before the launch)"),
        "open": ("fail", "something already listens there: the rendezvous cannot bind it"),
        "silent": ("warn", f"no answer within {timeout:g} s: a firewall drops it?"),
    }[state]
    rows.append(
        Check(
            f"rendezvous port {first.addr}:{port}",
            verdict,
            detail,
            "" if verdict == "ok" else "another PERSEUS_MASTER_PORT, or open the port",
        )
    )
    return rows


def check_packages() -> list[Check]:
    rows = []
    for mod, why in (("cupy", "aiak's CUDA kernels (NVRTC)"),):
        found = importlib.util.find_spec(mod) is not None
        rows.append(
            Check(
                mod,
                "ok" if found else "info",
                "installed" if found else f"not installed: {why} fall back to torch ops",
                "" if found else "pip install 'aiak[cuda12]' (or cuda13) on GPU machines",
            )
        )
    return rows


CHECKS: tuple[Callable[..., list[Check]], ...] = (
    check_install,
    check_gpus,
    check_nccl,
    check_rdma,
    check_nics,
    check_variables,
    check_packages,
)


def run_checks(environ: Mapping[str, str] | None = None, hosts: str | None = None) -> list[Check]:
    env = dict(os.environ if environ is None else environ)
    rows: list[Check] = []
    checks: list[Callable[[], list[Check]]] = [
        (lambda c=c: c(env)) if c.__code__.co_argcount else c for c in CHECKS
    ]
    if hosts:
        port = env.get("PERSEUS_MASTER_PORT") or "6666"
        port_ok = port.isdigit() and 0 < int(port) < 65536
        checks.append(lambda: check_hosts(hosts, int(port)) if port_ok else [])
    for check in checks:
        try:
            rows.extend(check())
        except Exception as e:  # a broken check is a row, not a crash of the doctor
            name = getattr(check, "__name__", "check")
            rows.append(Check(name, "fail", f"{type(e).__name__}: {e}", "report this"))
    return rows


def _table(rows: Sequence[Check]) -> str:
    heads = ("check", "verdict", "detail", "fix")
    data = [(r.name, r.verdict.upper(), r.detail, r.fix) for r in rows]
    width = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(heads[:2])]
    lines = [f"{heads[0]:<{width[0]}}  {heads[1]:<{width[1]}}  detail / fix"]
    for name, verdict, detail, fix in data:
        lines.append(f"{name:<{width[0]}}  {verdict:<{width[1]}}  {detail}")
        if fix:
            lines.append(f"{'':<{width[0]}}  {'':<{width[1]}}  -> {fix}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aiak-doctor", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("-H", "--hosts", help="aiakrun's host[=addr][:slots],...: check them")
    args = p.parse_args(argv)
    rows = run_checks(hosts=args.hosts)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(_table(rows))
    return 1 if any(r.verdict == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
