"""``aiak-conformance``: run the conformance suite on the device at hand.

    aiak-conformance                      # every case, on cuda if there is one, else cpu
    aiak-conformance --device cuda --bench --json out.json --markdown out.md
    aiak-conformance --list --filter l2norm

Exit status: 0 when every check passed, 1 when any failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from aiak.conformance.harness import Case, Result, all_cases, run_case
from aiak.conformance.report import environment, markdown, summary, write_json


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiak-conformance",
        description="Numerical conformance of aiak's ops, optimizers, hooks and amp modes "
        "against reference PyTorch (tolerance policy: docs/conformance.md).",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when a GPU is visible, else cpu (default)",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="REGEX",
        help="run only cases whose 'name variant' matches (repeatable)",
    )
    p.add_argument("--list", action="store_true", help="list the cases and variants, run nothing")
    p.add_argument(
        "--bench",
        action="store_true",
        help="on cuda, time bench variants against the PyTorch baseline",
    )
    p.add_argument(
        "--large",
        action="store_true",
        help="also run large variants (> 2^31 elements; needs ~16 GB of GPU memory)",
    )
    p.add_argument("--seed", type=int, default=None, help="base seed (default: fresh each run)")
    p.add_argument("--json", type=Path, default=Path("conformance-report.json"), metavar="PATH")
    p.add_argument("--markdown", type=Path, default=Path("conformance-report.md"), metavar="PATH")
    p.add_argument(
        "--env", action="store_true", help="print the environment and kernel backends, run nothing"
    )
    return p


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "aiak-conformance: --device cuda but torch.cuda.is_available() is False"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _selected(
    cases: Sequence[Case], device: torch.device, filters: Sequence[str], large: bool
) -> list[tuple[Case, int]]:
    """(case, number of variants to run) for cases runnable on ``device`` matching filters."""
    pats = [re.compile(f) for f in filters]
    chosen = []
    for case in cases:
        if device.type not in case.devices:
            continue
        specs = [s for s in case.specs(device) if large or not s.large]
        specs = [s for s in specs if all(p.search(f"{case.name} {s.label}") for p in pats)]
        if specs:
            chosen.append((case, len(specs)))
    return chosen


def _filtered(case: Case, filters: Sequence[str]) -> Case:
    pats = [re.compile(f) for f in filters]
    if not pats:
        return case
    import dataclasses

    def specs(device: torch.device):
        return [
            s for s in case.specs(device) if all(p.search(f"{case.name} {s.label}") for p in pats)
        ]

    return dataclasses.replace(case, specs=specs)


def _print_table(results: Sequence[Result], console) -> None:
    try:
        from rich.table import Table
    except ImportError:
        for r in results:
            err = max(r.errors.values(), default=0.0)
            speed = f" {r.speedup:.2f}x" if r.speedup else ""
            status = "ok  " if r.passed else "FAIL"
            print(
                f"{status} {r.case} [{r.label}] err {err:.2e} tol {r.tolerance:.0e}{speed} "
                f"{r.message}"
            )
        return
    table = Table(title="aiak conformance")
    for col in ("case", "variant", "ok", "max rel err", "tol", "ours ms", "torch ms", "speedup"):
        table.add_column(col, justify="right" if col not in ("case", "variant") else "left")
    for r in results:
        err = max(r.errors.values(), default=0.0)
        table.add_row(
            r.case,
            r.label,
            "[green]yes" if r.passed else "[red]NO",
            f"{err:.2e}",
            f"{r.tolerance:.0e}",
            f"{r.candidate_ms:.3f}" if r.candidate_ms else "",
            f"{r.baseline_ms:.3f}" if r.baseline_ms else "",
            f"{r.speedup:.2f}x" if r.speedup else "",
        )
    console.print(table)
    for r in results:
        if not r.passed:
            console.print(
                f"[red]FAIL[/red] {r.case} [{r.label}] seed {r.seed}: {r.message}",
                markup=True,
                highlight=False,
            )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for f in args.filter:
        try:
            re.compile(f)
        except re.error as exc:
            print(
                f"aiak-conformance: --filter {f!r} is not a regular expression: {exc}",
                file=sys.stderr,
            )
            return 2
    device = _device(args.device)
    if args.env:
        import aiak.ops

        print(
            json.dumps(
                {"environment": environment(device), "backends": aiak.ops.backends()},
                indent=2,
                default=str,
            )
        )
        return 0
    chosen = _selected(all_cases(), device, args.filter, args.large)
    if not chosen:
        print(f"aiak-conformance: no case matches {args.filter} on {device.type}", file=sys.stderr)
        return 2
    if args.list:
        for case, _ in chosen:
            print(f"{case.name}: {case.description}")
            for s in _filtered(case, args.filter).specs(device):
                if args.large or not s.large:
                    flags = " [bench]" if s.bench else ""
                    flags += " [large]" if s.large else ""
                    print(f"    {s.label}{flags}")
        return 0

    results: list[Result] = []
    total = sum(n for _, n in chosen)
    try:
        from rich.console import Console
        from rich.progress import Progress

        # Not a terminal (CI logs, the GPU script): a wide table beats wrapped cells.
        console = Console(width=None if sys.stdout.isatty() else 200)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("conformance", total=total)
            for case, _ in chosen:
                progress.update(task, description=case.name)
                results += run_case(
                    _filtered(case, args.filter),
                    device,
                    seed=args.seed,
                    large=args.large,
                    bench=args.bench,
                    on_result=lambda _r: progress.advance(task),
                )
    except ImportError:
        console = None
        for case, n in chosen:
            print(f"{case.name}: {n} variants", flush=True)
            results += run_case(
                _filtered(case, args.filter),
                device,
                seed=args.seed,
                large=args.large,
                bench=args.bench,
            )

    env = environment(device)
    write_json(args.json, env, results)
    args.markdown.write_text(markdown(env, results))
    _print_table(results, console)
    s = summary(results)
    print(
        f"{s['passed']} passed, {s['failed']} failed  ({env['device_name']}; "
        f"report: {args.json}, {args.markdown})"
    )
    return 1 if s["failed"] else 0
