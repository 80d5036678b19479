"""aiakrun's feature flags: one row each, flag -> environment variable (-> subpackage).

A row with ``available=False`` is a flag that this version does not implement; it parses, and
then stops the launch with a clear error. A row's ``old`` is a former spelling that still works
and warns (``--rank`` was PowerSGD's rank, which reads as the process's rank).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["FLAGS", "Flag", "add_arguments", "environment"]


@dataclasses.dataclass(frozen=True)
class Flag:
    option: str  # the command-line option
    env: str  # the variable it sets
    kind: Callable[[str], Any] | None = None  # None: a switch (sets "1"); else the value's type
    help: str = ""
    available: bool = True
    needs: tuple[str, ...] = ()  # one of these options must be given too
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "+" for a list (joined with spaces in the variable)
    old: str | None = None  # a deprecated spelling of the option, still accepted

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def old_dest(self) -> str:
        return self.dest + "__old"


_DGC = ("--dgc",)
_OVERLAP = ("--overlap-backward-and-step",)

FLAGS: tuple[Flag, ...] = (
    Flag("--hierarchical-allreduce", "AIAK_HIERARCHICAL_ALLREDUCE", help="two-level allreduce"),
    Flag("--fp16-compression", "AIAK_FP16_COMPRESSION", help="gradients on the wire in fp16"),
    Flag("--powersgd", "AIAK_POWERSGD_COMPRESSION", help="PowerSGD low-rank compression"),
    Flag(
        "--powersgd-rank",
        "AIAK_MATRIX_APPROXIMATION_RANK",
        int,
        "PowerSGD's rank",
        needs=("--powersgd",),
        old="--rank",
    ),
    Flag(
        "--start-compress-iter",
        "AIAK_START_COMPRESS_ITER",
        int,
        "PowerSGD's first compressed step",
        needs=("--powersgd",),
    ),
    Flag("--nan-check", "PERSEUS_ALLREDUCE_NANCHECK", help="stop on a NaN/Inf gradient"),
    Flag(
        "--accumulate-n-steps",
        "PERSEUS_ACCUMULATE_N_STEPS",
        int,
        "micro-steps per optimizer step (scripts using aiak.comm.accumulate)",
    ),
    Flag("--fuse-optimizer", "AIAK_FUSED_OPTIMIZER", help="torch Adam/AdamW/SGD built fused"),
    Flag(
        "--downsample-n-elements",
        "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
        int,
        "send 1 gradient element in N per step (the others wait in a memory)",
    ),
    Flag(
        "--gradient-momentum",
        "PERSEUS_GRADIENT_MOMENTUM",
        float,
        "momentum of the elements downsampling keeps back",
        needs=("--downsample-n-elements",),
    ),
    Flag("--allreduce-streams", "PERSEUS_ALLREDUCE_STREAMS", int, "buckets over K groups"),
    Flag(
        "--allreduce-fusion",
        "PERSEUS_ALLREDUCE_FUSION",
        str,
        "DDP bucket size, MiB, or auto (DDP's own; 50 with --dgc)",
    ),
    Flag("--perf-check-n-steps", "PERSEUS_PERF_CHECK_N_STEPS", int, "slow-rank check period"),
    Flag("--comm-log-steps", "AIAK_COMM_LOG_STEPS", int, "log the hook's bytes every N steps"),
    # DGC (aiak.comm.dgc) and the backward/step overlap (aiak.comm.overlap_step).
    Flag("--dgc", "AIAK_DGC", help="DGC sparse gradient compression (SGD scripts)"),
    Flag("--compress-ratio", "AIAK_DGC_COMPRESS_RATIO", float, "DGC", needs=_DGC),
    Flag("--sample-ratio", "AIAK_DGC_SAMPLE_RATIO", float, "DGC", needs=_DGC),
    Flag("--strided-sample", "AIAK_DGC_STRIDED_SAMPLE", int, "DGC (0/1)", needs=_DGC),
    Flag("--compress-upper-bound", "AIAK_DGC_COMPRESS_UPPER_BOUND", float, "DGC", needs=_DGC),
    Flag("--compress-lower-bound", "AIAK_DGC_COMPRESS_LOWER_BOUND", float, "DGC", needs=_DGC),
    Flag("--max-adaptation-iters", "AIAK_DGC_MAX_ADAPTATION_ITERS", int, "DGC", needs=_DGC),
    Flag("--resample", "AIAK_DGC_RESAMPLE", int, "DGC (0/1)", needs=_DGC),
    Flag("--fp16-values", "AIAK_DGC_FP16_VALUES", int, "DGC (0/1)", needs=_DGC),
    Flag("--int32-indices", "AIAK_DGC_INT32_INDICES", int, "DGC (0/1)", needs=_DGC),
    Flag("--warmup-epochs", "AIAK_DGC_WARMUP_EPOCHS", int, "DGC", needs=_DGC),
    Flag("--warmup-coeff", "AIAK_DGC_WARMUP_COEFF", float, "DGC", needs=_DGC, nargs="+"),
    Flag("--momentum-masking", "AIAK_DGC_MOMENTUM_MASKING", int, "DGC (0/1)", needs=_DGC),
    Flag(
        "--overlap-backward-and-step",
        "AIAK_OVERLAP_BACKWARD_AND_STEP",
        help="update parameters while gradients communicate (the script's step() is a no-op)",
    ),
    Flag(
        "--clip-grad-func",
        "AIAK_CLIP_GRAD_FUNC",
        str,
        "gradient clipping inside DGC / the overlap",
        needs=_DGC + _OVERLAP,
        choices=("norm", "value"),
    ),
    Flag(
        "--clip-grad-func-params",
        "AIAK_CLIP_GRAD_FUNC_PARAMS",
        float,
        "the clipping's max norm / value",
        needs=("--clip-grad-func",),
    ),
)

# Pairs that cannot run together (e.g. the fused optimizer and the overlap, which steps its own).
CONFLICTS: tuple[tuple[str, str, str], ...] = (
    ("--fuse-optimizer", "--overlap-backward-and-step", "the overlap steps its own optimizer"),
    ("--powersgd", "--fp16-compression", "choose one compression"),
    ("--dgc", "--powersgd", "choose one compression"),
    ("--dgc", "--fp16-compression", "choose one compression"),
    ("--dgc", "--hierarchical-allreduce", "DGC's allgather runs over all ranks"),
    ("--dgc", "--fuse-optimizer", "DGC steps its own SGD"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("features (each sets an environment variable)")
    for f in FLAGS:
        text = f"{f.help} [{f.env}]" + ("" if f.available else " (not available in this version)")
        for option, dest, shown in ((f.option, f.dest, text), (f.old, f.old_dest, None)):
            if option is None:
                continue
            shown = shown if shown is not None else argparse.SUPPRESS
            if f.kind is None:
                group.add_argument(option, dest=dest, action="store_true", help=shown)
            else:
                group.add_argument(
                    option, dest=dest, type=f.kind, choices=f.choices, nargs=f.nargs, help=shown
                )


def _merge_old(args: argparse.Namespace, flags: Sequence[Flag]) -> None:
    """A deprecated spelling's value goes to its flag (the new spelling wins when both)."""
    for f in flags:
        if f.old is None:
            continue
        old = getattr(args, f.old_dest, None)
        if old not in (None, False) and getattr(args, f.dest) in (None, False):
            setattr(args, f.dest, old)


def deprecations(args: argparse.Namespace, flags: Sequence[Flag] = FLAGS) -> list[str]:
    """One line per deprecated spelling the command line used."""
    return [
        f"{f.old} is deprecated: it means {f.option} ({f.help})"
        for f in flags
        if f.old is not None and getattr(args, f.old_dest, None) not in (None, False)
    ]


def _given(args: argparse.Namespace, f: Flag) -> bool:
    value = getattr(args, f.dest)
    return bool(value) if f.kind is None else value is not None


def environment(args: argparse.Namespace, flags: Sequence[Flag] = FLAGS) -> dict[str, str]:
    """The variables the flags ask for; ``ValueError`` on a conflict, a missing companion
    flag or a feature this version does not have (checked in that order)."""
    _merge_old(args, flags)
    given = {f.option for f in flags if _given(args, f)}
    for a, b, why in CONFLICTS:
        if a in given and b in given:
            raise ValueError(f"aiakrun: {a} and {b} cannot be combined ({why})")
    for f in flags:
        if f.option in given and f.needs and not given.intersection(f.needs):
            raise ValueError(f"aiakrun: {f.option} needs {' or '.join(f.needs)}")
    missing = [f.option for f in flags if f.option in given and not f.available]
    if missing:
        raise ValueError(f"aiakrun: {', '.join(missing)}: not available in this version of aiak")
    env: dict[str, str] = {}
    for f in flags:
        if f.option not in given:
            continue
        value = getattr(args, f.dest)
        if f.kind is None:
            env[f.env] = "1"
        elif isinstance(value, list):
            env[f.env] = " ".join(str(v) for v in value)
        else:
            env[f.env] = str(value)
    return env


def describe(env: Mapping[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]
