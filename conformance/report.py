"""The conformance report: environment record, JSON and Markdown output."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiak.conformance.harness import Result


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, compute capability, driver, CUDA, torch and cupy versions, the date."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "compute_capability": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "cupy": next(
            filter(None, (_version(d) for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy"))), None
        ),
        "python": platform.python_version(),
        "aiak": _version("aiak"),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["driver"] = _driver()
    return env


def write_json(path: Path, env: dict[str, Any], results: Sequence[Result]) -> None:
    doc = {
        "environment": env,
        "summary": summary(results),
        "results": [r.as_dict() for r in results],
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def summary(results: Sequence[Result]) -> dict[str, int]:
    failed = sum(not r.passed for r in results)
    return {
        "cases": len({r.case for r in results}),
        "checks": len(results),
        "passed": len(results) - failed,
        "failed": failed,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(env: dict[str, Any], results: Sequence[Result]) -> str:
    s = summary(results)
    lines = [
        "# aiak conformance report",
        "",
        f"{env['date']} · {env['device_name']} ({env['device']}, cc {env['compute_capability']}, "
        f"driver {env['driver']}, CUDA {env['cuda']}) · torch {env['torch']} · "
        f"cupy {env['cupy']}",
        "",
        f"**{s['passed']} passed, {s['failed']} failed** ({s['checks']} checks in "
        f"{s['cases']} cases)",
        "",
        "| case | variant | dtype | ok | max rel err | tol | ours ms | torch ms | speedup | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        err = max(r.errors.values(), default=0.0)
        lines.append(
            f"| {r.case} | {r.label} | {r.dtype} | {'yes' if r.passed else '**NO**'} | "
            f"{err:.2e} | {r.tolerance:.0e} | {_fmt(r.candidate_ms, '.3f')} | "
            f"{_fmt(r.baseline_ms, '.3f')} | {_fmt(r.speedup, '.2f')} | "
            f"{r.message.replace('|', '/')[:160]} |"
        )
    return "\n".join(lines) + "\n"
