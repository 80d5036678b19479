"""``aiak-advise``: measure a training script for a few steps and say what to switch on.

    aiak-advise [--steps N] [--seconds S] [--verify] [--json] [--png PATH] \\
        [aiakrun options] -- python train.py ...

The script runs unchanged through ``aiakrun`` (same flags, same activation), with aiak-advise's
probe (``aiak.launch._advise_probe``) installed by a start-up folder that leads PYTHONPATH.
Each rank writes its measurements to a file in a temporary folder and stops after the measured
steps; aiak-advise attributes the step (``_advise_model``), prints the ranked advice, and with
``--verify`` runs again with the first advice switched on and prints both steps. The user's
files are never written; every process started is killed when ``--limit`` seconds pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from aiak.launch import _advise_model as model
from aiak.launch import _advise_report as report
from aiak.launch import flags as _flags

__all__ = ["AdviseError", "main", "measure"]

# sitecustomize of the run's start-up folder: installs the probe, then runs the next
# sitecustomize on sys.path (aiak's own start-up folder comes before it and chains to it).
_SITECUSTOMIZE = '''"""aiak-advise's start-up hook (a temporary folder; removed after the run)."""
import os

from aiak.launch import _advise_probe

_advise_probe.boot()


def _chain():
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    seen = False
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        if folder == here:
            seen = True
            continue
        path = os.path.join(folder, "sitecustomize.py")
        if not seen or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_aiak_advise_next_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


_chain()
del _chain
'''


class AdviseError(RuntimeError):
    """The measured run failed; the message carries the script's output."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiak-advise",
        description="Measure a training script for a few steps and say which aiak features "
        "to switch on. Options not listed here go to aiakrun.",
        usage="aiak-advise [options] [aiakrun options] -- COMMAND [ARG...]",
        allow_abbrev=False,
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 30)")
    p.add_argument("--warmup-steps", type=int, default=5, help="unmeasured first steps (>= 2)")
    p.add_argument("--seconds", type=float, default=None, help="measure for this long instead")
    p.add_argument("--verify", action="store_true", help="re-run with the first advice on")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--png", default=None, help="draw the step's breakdown to this PNG")
    p.add_argument("--limit", type=float, default=600.0, help="seconds per run before kill")
    p.add_argument("--show-output", action="store_true", help="print the script's output")
    p.add_argument("--keep-dir", default=None, help="keep the rank reports in this folder")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.steps is None:  # --seconds alone bounds the run by time
        args.steps = 30 if args.seconds is None else 10**9
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup_steps < 2:
        raise ValueError(
            f"--warmup-steps must be >= 2 (one step counts ops), got {args.warmup_steps}"
        )
    if args.seconds is not None and not 0 < args.seconds < float("inf"):
        raise ValueError(f"--seconds must be a positive number, got {args.seconds}")
    if not 0 < args.limit < float("inf"):
        raise ValueError(f"--limit must be a positive number of seconds, got {args.limit}")


def features_on(aiakrun_args: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The feature variables the run has: the environment's AIAK_/PERSEUS_ ones, then the
    flags' (aiakrun's own table); ``ValueError`` for flags aiakrun would refuse."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _flags.add_arguments(p)
    ns, _ = p.parse_known_args(list(aiakrun_args))
    on = {k: v for k, v in environ.items() if k.startswith(("AIAK_", "PERSEUS_"))}
    on.update(_flags.environment(ns))
    return on


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _stop(proc: subprocess.Popen, folder: str, grace: float = 10.0) -> None:
    """SIGTERM to the launcher's group (torch's launcher stops its workers), then SIGKILL to
    it and to every worker's own session (the probe wrote their pids)."""
    if proc.poll() is None:
        _kill_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    _kill_group(proc.pid, signal.SIGKILL)
    for pid in _worker_pids(folder):
        _kill_group(pid, signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _worker_pids(folder: str) -> list[int]:
    pids = []
    for name in os.listdir(folder):
        if name.startswith("pid") and name[3:].isdigit():
            with open(os.path.join(folder, name)) as f:
                text = f.read().strip()
            if text.isdigit():
                pids.append(int(text))
    return pids


def measure(
    aiakrun_args: Sequence[str],
    command: Sequence[str],
    steps: int = 30,
    warmup: int = 5,
    seconds: float | None = None,
    limit: float = 600.0,
    trial: str | None = None,
    keep_dir: str | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Run ``aiakrun ARGS -- COMMAND`` with the probe; the rank reports and the output."""
    folder = tempfile.mkdtemp(prefix="aiak-advise-")
    try:
        site = os.path.join(folder, "site")
        os.mkdir(site)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
        env = dict(os.environ)
        env.pop("AIAK_ADVISE_OWNER", None)  # set inside measured ranks only
        env.update(
            AIAK_ADVISE_DIR=folder,
            AIAK_ADVISE_STEPS=str(steps),
            AIAK_ADVISE_WARMUP=str(warmup),
            AIAK_ADVISE_SECONDS="" if seconds is None else str(seconds),
            AIAK_ADVISE_TRY=trial or "",
        )
        path = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = site + (os.pathsep + path if path else "")
        argv = [sys.executable, "-m", "aiak.launch.run", *aiakrun_args, "--", *command]
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(proc, folder)
            out, _ = proc.communicate()
            raise AdviseError(
                f"the run outlived --limit {limit:g} s and was killed; its output:\n" + _tail(out)
            ) from None
        finally:
            if proc.returncode is None:
                _stop(proc, folder)
        for pid in _worker_pids(folder):  # data-loader workers a rank left behind
            _kill_group(pid, signal.SIGKILL)
        reports = []
        for name in sorted(os.listdir(folder)):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    reports.append(json.load(f))
        if proc.returncode != 0:
            raise AdviseError(
                f"the script failed (aiakrun exit {proc.returncode}); its output:\n" + _tail(out)
            )
        if not reports:
            raise AdviseError(
                "the script ran but no rank reported: it never imported torch, or is not a "
                "Python process started by aiakrun; its output:\n" + _tail(out)
            )
        if keep_dir:
            os.makedirs(keep_dir, exist_ok=True)
            for name in os.listdir(folder):
                if name.endswith(".json"):
                    shutil.copy(os.path.join(folder, name), keep_dir)
        return reports, out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _tail(out: str | None, lines: int = 60) -> str:
    return "\n".join((out or "").splitlines()[-lines:])


def _verify(
    args: argparse.Namespace,
    aiakrun_args: list[str],
    command: list[str],
    before: model.Breakdown,
    advice: Sequence[model.Advice],
) -> tuple[dict[str, Any], model.Breakdown | None]:
    for a in advice:
        if not a.flags and not a.trial:
            continue
        extra = list(a.flags)
        if "--powersgd" in extra and "--start-compress-iter" not in extra:
            extra += ["--start-compress-iter", "2"]  # compress the measured steps
        if extra:
            try:
                features_on([*aiakrun_args, *extra], os.environ)
            except ValueError as e:
                return {"skipped": f"{a.feature}: {e}"}, None
        reports, _ = measure(
            [*extra, *aiakrun_args],
            command,
            args.steps,
            args.warmup_steps,
            args.seconds,
            args.limit,
            trial=a.trial,
        )
        after = model.breakdown(reports)
        # a trial the probe could not apply (a model wrapped in DDP first, ...) verifies nothing
        status = (after.facts.get("trials") or {}).get(a.trial or "", "applied")
        if status != "applied":
            return {"skipped": f"{a.feature}: {status}"}, None
        how = (
            "aiakrun " + " ".join(extra)
            if extra
            else f"applied for this run by the probe ({a.trial}); your script needs: {a.use}"
        )
        predicted = None if a.gain_s is None else before.step - a.gain_s
        result = {
            "feature": a.feature,
            "how": how,
            "before_s": before.step,
            "after_s": after.step,
            "predicted_s": predicted,
            "speedup": before.step / after.step if after.step > 0 else None,
            # docs/advise.md states how far from the prediction a verified step may land
            "measured_over_predicted": after.step / predicted if predicted else None,
            "after": after.as_dict(),
        }
        return result, after
    first = advice[0].feature if advice else "nothing"
    return {"skipped": f"no advice can be switched on by aiak-advise (first: {first})"}, None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if "--" not in argv:
        parser.print_usage(sys.stderr)
        print("aiak-advise: error: put the command after '--'", file=sys.stderr)
        return 2
    i = argv.index("--")
    own, command = argv[:i], argv[i + 1 :]
    try:
        args, aiakrun_args = parser.parse_known_args(own)
        _check(args)
        if not command:
            raise ValueError("no command after '--'")
        on = features_on(aiakrun_args, os.environ)
    except ValueError as e:
        print(f"aiak-advise: error: {e}", file=sys.stderr)
        return 2
    run = {
        "command": command,
        "aiakrun": aiakrun_args,
        "steps": args.steps,
        "seconds": args.seconds,
        "warmup": args.warmup_steps,
    }
    try:
        reports, out = measure(
            aiakrun_args,
            command,
            args.steps,
            args.warmup_steps,
            args.seconds,
            args.limit,
            keep_dir=args.keep_dir,
        )
        if args.show_output:
            print(out, file=sys.stderr)
        run["incomplete_ranks"] = [r["rank"] for r in reports if not r.get("complete")]
        before = model.breakdown(reports)
        advice = model.advise(before, on)
        verify, after = (None, None)
        if args.verify:
            verify, after = _verify(args, aiakrun_args, command, before, advice)
    except (AdviseError, ValueError) as e:
        print(f"aiak-advise: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.document(before, advice, run, verify), indent=1, default=str))
    else:
        print(report.text(before, advice, run, verify))
    if args.png:
        bars = [("before", before)] + ([("after", after)] if after is not None else [])
        why = report.draw(args.png, bars)
        print(f"aiak-advise: {why}" if why else f"aiak-advise: wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
