"""aiak-advise's output: the text report, the JSON document and the PNG of the step."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from aiak.launch._advise_breakdown import PHASES, Breakdown
from aiak.launch._advise_model import Advice, not_helping

__all__ = ["document", "draw", "text"]

_WHAT = {
    "data": "waiting for data is",
    "host": "the forward and backward wait on the host's per-op cost:",
    "compute": "the forward and backward's own work is",
    "link": "communication the backward does not hide is",
    "ranks": "ranks waiting for each other in the communication the backward does not hide:",
    "optimizer": "the optimizer's step is",
    "loop": "the script's own code between the phases is",
}
_PHASE_OF = {"host": "compute", "link": "comm", "ranks": "comm", "loop": "other"}


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _model_line(f: Mapping[str, Any], comm: float) -> str:
    opt = f.get("optimizer") or {}
    world = int(f.get("world", 1))
    parts = []
    if opt:
        parts.append(
            f"{opt.get('parameters', 0):,} parameters in {opt.get('tensors', 0)} tensors "
            f"({', '.join(opt.get('dtypes', []))}), optimizer {opt.get('type')} "
            f"({opt.get('module')}, {opt.get('groups')} group(s))"
        )
    else:
        parts.append("no optimizer seen")
    amp = "aiak O2" if opt.get("aiak_o2") else None
    auto = f.get("autocast")
    parts.append("AMP: " + (" + ".join(filter(None, (amp, auto and f"autocast {auto}"))) or "none"))
    if f.get("ddp"):
        buckets = f.get("buckets")
        parts.append(
            f"DDP {buckets if buckets is not None else '?'} bucket(s), "
            f"{f.get('grad_bytes', 0) / 2**20:.2f} MiB of gradients per step"
        )
        if comm > 0 and f.get("grad_bytes") and world > 1:
            ring = 2 * (world - 1) / world * f["grad_bytes"]  # bytes each rank sends
            parts.append(f"exposed comm at {ring / comm / 1e6:.0f} MB/s effective")
    for loader in f.get("loaders", []):
        parts.append(
            f"DataLoader num_workers={loader.get('num_workers')} "
            f"persistent={loader.get('persistent_workers')} batches={loader.get('batches')}"
        )
    return "; ".join(parts)


def text(
    b: Breakdown,
    advice: Sequence[Advice],
    run: Mapping[str, Any],
    verify: Mapping[str, Any] | None = None,
) -> str:
    f = b.facts
    world, local = int(f.get("world", 1)), max(1, int(f.get("local_world", 1)))
    nodes = max(1, world // local)
    lines = [
        f"aiak-advise: {world} rank(s) on {nodes} node(s), backend {f.get('backend') or 'none'}, "
        f"{'CUDA' if f.get('cuda') else 'CPU'}; {b.steps} steps measured after "
        f"{run.get('warmup')} of warm-up ({b.ranks} rank report(s))",
        "step "
        + _ms(b.step)
        + ": "
        + " | ".join(f"{p} {_ms(getattr(b, p))} ({b.share(p):.0%})" for p in PHASES),
        f"  data at epoch starts {_ms(b.data_epoch_start)}; host share of the ops: "
        + ", ".join(f"{k} {v:.0%}" for k, v in b.host.items())
        + ("" if b.gpu_idle is None else f"; GPU queue empty at {b.gpu_idle:.0%} of boundaries"),
        "model: " + _model_line(f, b.comm),
    ]
    if b.clock == "gpu":
        lines.insert(
            3,
            "  phases on the GPU's clock (CUDA events at their boundaries); the host's: "
            + " | ".join(
                f"{p} {_ms(b.host_s.get(p, 0.0))}"
                for p in ("data", "forward", "backward", "comm", "optimizer")
            ),
        )
    if run.get("incomplete_ranks"):
        lines.append(
            f"  note: rank(s) {run['incomplete_ranks']} ended before the last measured step "
            "(the script finished first): fewer steps, and no link timing"
        )
    name = b.bottleneck()
    lines.append(
        f"bottleneck: {name} — {_WHAT[name]} {b.share(_PHASE_OF.get(name, name)):.0%} of the step"
    )
    lines.append("")
    if advice:
        lines.append(
            "advice, best first (expected gain per step from the cost model, docs/advise.md):"
        )
    else:
        lines.append("advice: nothing in aiak's cost model saves 2% of this step or more")
    for i, a in enumerate(advice, 1):
        gain = (
            "gain not estimated"
            if a.gain_s is None
            else (f"-{_ms(a.gain_s)} ({a.gain_s / b.step:.0%} of the step)")
        )
        tag = "aiak" if a.aiak else "outside aiak"
        lines.append(f" {i}. {a.feature} [{tag}]  {gain}")
        lines.append(f"    why: {a.why}")
        lines.append(f"    use: {a.use}")
        lines.append(f"    will not help: {a.not_helps}")
        if a.changes_update:
            lines.append("    note: it changes the update; check convergence before relying on it")
    rest = not_helping(b)
    if rest:
        lines.append("not needed here:")
        lines.extend(f"  - {r}" for r in rest)
    if verify:
        lines.append("")
        lines.extend(_verify_lines(verify))
    return "\n".join(lines)


def _verify_lines(v: Mapping[str, Any]) -> list[str]:
    if v.get("skipped"):
        return [f"verify: {v['skipped']}"]
    before, after, predicted = v["before_s"], v["after_s"], v.get("predicted_s")
    line = f"  before {_ms(before)} per step, after {_ms(after)}: x{before / after:.2f}"
    if predicted is None:
        line += " (no prediction: the gain is not estimated)"
    else:
        line += (
            f" (predicted {_ms(predicted)}, x{before / max(predicted, 1e-9):.2f}; "
            f"measured / predicted step {after / max(predicted, 1e-9):.2f})"
        )
    return [f"verify: {v['feature']} ({v['how']})", line]


def document(
    b: Breakdown,
    advice: Sequence[Advice],
    run: Mapping[str, Any],
    verify: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "run": dict(run),
        "breakdown": b.as_dict(),
        "facts": _facts(b.facts),
        "advice": [a.as_dict(b.step) for a in advice],
        "not_needed": not_helping(b),
        "verify": None if verify is None else dict(verify),
    }


def _facts(facts: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(facts)
    if out.get("optimizer"):  # the shapes feed the cost model; the document keeps a count
        out["optimizer"] = {k: v for k, v in out["optimizer"].items() if k != "shapes"}
    return out


def draw(path: str, bars: Sequence[tuple[str, Breakdown]]) -> str | None:
    """A PNG of each step's breakdown (stacked ms); the reason when it cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'aiak[bench]'): no PNG"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(bars)))
    colors = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#937860")
    for y, (_, b) in enumerate(bars):
        left = 0.0
        for p, color in zip(PHASES, colors):
            width = getattr(b, p) * 1e3
            ax.barh(y, width, left=left, color=color, label=p if y == 0 else None)
            left += width
        ax.text(left, y, f" {b.step * 1e3:.1f} ms", va="center")
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.set_xlabel("ms per step")
    ax.legend(ncol=len(PHASES), loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
