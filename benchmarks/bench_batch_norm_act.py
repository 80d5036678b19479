"""aiak.ops.batch_norm_act vs torch's batch norm, residual add and ReLU as torchvision runs them.

    python benchmarks/bench_batch_norm_act.py [--shapes 64x112,256x56,1024x14 | all]
        [--batch 128] [--dtype float16] [--variants relu,add_relu] [--no-check]

The batch norms of torchvision's ResNet-50 (v1.5) at batch 128 and 224 px, laid out and typed
as in channels_last O2 training: fp16 activations, fp32 weight, bias and running statistics. A
shape is ``CxS`` (C channels, S x S pixels, ``--batch`` images) or ``NxCxHxW``; the default is
a representative subset (the stem, a narrow and a wide layer-1 bn, the bottleneck outputs of
layers 2-4); ``all`` is every one of the network's 12 distinct shapes, and adds its sum.

Two variants per shape: ``relu`` (bn, then ReLU: every bn1 and bn2, and the stem's) and
``add_relu`` (bn, ``+= identity``, ReLU: every bn3). Baseline, torchvision's spelling:
``out = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)``, ``out += identity``,
``torch.relu_(out)`` (``nn.ReLU(inplace=True)``); candidate: ``batch_norm_act(x, rm, rv, w, b,
True, 0.1, 1e-5, residual=identity)``. Inputs require grad, as in training.

Forward alone, and forward + backward: ``torch.autograd.grad`` of x, weight, bias (and the
residual) against one fixed random gradient, so nothing accumulates into ``.grad`` and neither
side pays an accumulation kernel. GPU time in µs: the p50 of CUDA-graph replays (pipelined time
where a call cannot be captured). ``fwd_x`` / ``fwdbwd_x``: torch's time over ours. A last
table times both on a [32, 64, 8, 8] input, calls back to back (pipelined p50, ``timing``
column ``pipelined``): too little GPU work to hide the host's, so each one's host cost.

"% copy" (memory-bound op): the least traffic any fused implementation needs, over the
device-to-device copy bandwidth of the same run: forward, x read once + the residual read once
+ y written once (the op's two passes read x twice: its ceiling is below 100%); backward, the
incoming gradient, x and y (the ReLU's mask) read once each + dx and the residual's gradient
written once; forward + backward, the two added.

``--check`` (default on): before timing, each variant's outputs (y, dx, dweight, dbias,
dresidual, the running mean and variance after one call) against the baseline's maths in
float64, as relative L2 errors (``err_*``, ``max_rel_err``; torch's own largest beside it,
``torch_max_rel_err``), flagged FAIL past the conformance policy's bound for the dtype (fp16
5e-3, bf16 2e-2, fp32 1e-5); any FAIL makes the exit status 1. Not against torch's fp16 outputs
directly: torch rounds the batch norm's output to fp16 before the add, which moves the sign of
y at the ReLU's kink often enough to put 1e-2 between the two implementations' gradients
(measured on [32, 64, 28, 28]). For the same reason the check zeroes the incoming gradient
where |bn(x) + residual| < 1e-3 in float64 (0.1% of it), and the timings use that gradient.

With ``all``, the ResNet-50 row: each shape's time times the number of its layers of that
variant in the network, summed over the 49 batch norms ``aiak.ops.resnet.convert`` fuses (the 4
of the downsample branches, no ReLU after them, stay torch's and are left out). Rows go to
benchmarks/results/batch_norm_act.csv.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.nn.functional as F
from _harness import append_csv, copy_bandwidth, print_table, time_graph, time_pipelined

from aiak.conformance.harness import tolerance
from aiak.ops.batch_norm_act import CAP, batch_norm_act

VARIANTS = {"relu": False, "add_relu": True}  # variant -> has a residual
DEFAULT_SHAPES = "64x112,64x56,256x56,512x28,1024x14,2048x7"
MOMENTUM, EPS = 0.1, 1e-5
HOST_SHAPE = (32, 64, 8, 8)  # host-bound: GPU work of a few µs per kernel
KINK = 1e-3  # |y| under which --check zeroes the incoming gradient (module docstring)


def resnet50_layers(size: int = 224) -> list[tuple[int, int, str]]:
    """(C, S, variant) of each batch norm torchvision's ResNet-50 follows with a ReLU, in order
    (49 of its 53: the downsample branches' 4 have none). v1.5: a stage's first block strides in
    conv2, so its bn1 runs at the previous stage's resolution and its bn2, bn3 at the new one."""
    s = size // 2  # the stem's 7x7 conv, stride 2
    layers = [(64, s, "relu")]
    s //= 2  # max pool
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for b in range(blocks):
            layers.append((width, s, "relu"))  # bn1, after the 1x1 conv1
            if stage > 0 and b == 0:
                s //= 2  # conv2 carries the stride
            layers.append((width, s, "relu"))  # bn2
            layers.append((4 * width, s, "add_relu"))  # bn3, += identity, relu
    return layers


RESNET50 = collections.Counter(resnet50_layers())  # (C, S, variant) -> layers
RESNET50_SHAPES = sorted({(c, s) for c, s, _ in RESNET50}, key=lambda cs: (-cs[1], cs[0]))


def _parse_shapes(text: str, batch: int) -> list[tuple[int, int, int, int]]:
    if text == "all":
        return [(batch, c, s, s) for c, s in RESNET50_SHAPES]
    shapes = []
    for item in text.split(","):
        dims = [int(d) for d in item.lower().split("x")]
        if len(dims) == 2:
            shapes.append((batch, dims[0], dims[1], dims[1]))
        elif len(dims) == 4:
            shapes.append(tuple(dims))
        else:
            raise ValueError(f"shape {item!r} is neither CxS nor NxCxHxW")
    return shapes


def _torch(x, res, rm, rv, w, b):
    """torchvision's Bottleneck: ``out = self.bn(x)``, ``out += identity``, ``self.relu(out)``."""
    out = F.batch_norm(x, rm, rv, w, b, True, MOMENTUM, EPS)
    if res is not None:
        out += res
    return torch.relu_(out)


def _ours(x, res, rm, rv, w, b):
    return batch_norm_act(x, rm, rv, w, b, True, MOMENTUM, EPS, residual=res)


def _time(fn) -> float:
    t = time_graph(fn)
    if t is None:
        t = time_pipelined(fn)
    return t[1] * 1e3  # p50 in us


def _time_pipelined(fn) -> float:
    return time_pipelined(fn)[1] * 1e3  # p50 in us: max(host, GPU) per call


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    diff = torch.linalg.vector_norm(out - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    return diff / scale if scale > 0 else diff


def _inputs(shape, dtype: torch.dtype, residual: bool) -> dict:
    c = shape[1]

    def act():
        return torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)

    return {
        "x": act().requires_grad_(),
        "res": act().requires_grad_() if residual else None,
        "w": (0.5 + torch.rand(c, device="cuda")).requires_grad_(),
        "b": (0.1 * torch.randn(c, device="cuda")).requires_grad_(),
        "grad": act(),
        "stats": (torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")),
    }


def _leaves(inp: dict) -> list[torch.Tensor]:
    return [t for t in (inp["x"], inp["w"], inp["b"], inp["res"]) if t is not None]


def _outputs(inp: dict, fn, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """y, the gradients and the running statistics after one call of ``fn`` (fresh statistics;
    ``dtype``: on copies of the inputs in that dtype)."""
    x, res, w, b = (
        t.detach().to(dtype).requires_grad_() if dtype and t is not None else t
        for t in (inp["x"], inp["res"], inp["w"], inp["b"])
    )
    rm, rv = (t.to(dtype or t.dtype, copy=True) for t in inp["stats"])
    leaves = [t for t in (x, w, b, res) if t is not None]
    y = fn(x, res, rm, rv, w, b)
    if dtype is not None:  # the reference: the incoming gradient zeroed at the ReLU's kink
        with torch.no_grad():
            pre = F.batch_norm(x, rm.clone(), rv.clone(), w, b, True, MOMENTUM, EPS)
            pre = pre + res if res is not None else pre
        grad = torch.where(pre.abs() < KINK, 0.0, inp["grad"].to(dtype))
        inp["grad"] = grad.to(inp["grad"].dtype).contiguous(memory_format=torch.channels_last)
    grads = torch.autograd.grad(y, leaves, inp["grad"].to(dtype or y.dtype))
    names = ["y", "dx", "dweight", "dbias"] + (["dres"] if res is not None else [])
    return {**dict(zip(names, (y, *grads))), "running_mean": rm, "running_var": rv}


def _check(inp: dict) -> tuple[dict[str, float], float]:
    """Relative L2 errors of ours against the float64 reference, and torch's largest."""
    ref = _outputs(inp, _torch, torch.float64)
    ours, base = _outputs(inp, _ours), _outputs(inp, _torch)
    errors = {f"err_{k}": _rel_l2(ours[k], r) for k, r in ref.items()}
    return errors, max(_rel_l2(base[k], r) for k, r in ref.items())


def _measure(inp: dict, timer=_time) -> dict[str, float]:
    """(torch|ours)_(fwd|fwdbwd)_us of each (``timer``: GPU time by default), running
    statistics of their own."""
    times = {}
    leaves = _leaves(inp)
    for who, fn in (("torch", _torch), ("ours", _ours)):
        rm, rv = (t.clone() for t in inp["stats"])
        args = (inp["x"], inp["res"], rm, rv, inp["w"], inp["b"])
        times[f"{who}_fwd_us"] = timer(lambda fn=fn, args=args: fn(*args))
        times[f"{who}_fwdbwd_us"] = timer(
            lambda fn=fn, args=args: torch.autograd.grad(fn(*args), leaves, inp["grad"])
        )
    return times


def _rows(shapes, dtype, variants, check: bool, copy_gbs: float) -> list[dict]:
    bound = tolerance(dtype)
    rows = []
    for shape in shapes:
        for variant in variants:
            residual = VARIANTS[variant]
            inp = _inputs(shape, dtype, residual)
            numel, size = inp["x"].numel(), inp["x"].element_size()
            fwd_bytes = numel * size * (2 + residual)  # x, residual read; y written
            bwd_bytes = numel * size * (4 + residual)  # grad, x, y read; dx, dres written
            reasons = CAP.not_supported_reasons(inp["x"].device, (dtype,), (inp["x"], inp["w"]))
            row = {
                "timing": "graph",
                "shape": "x".join(map(str, shape)),
                "C": shape[1],
                "S": shape[2],
                "dtype": str(dtype).removeprefix("torch."),
                "variant": variant,
                "path": "fused" if not reasons else "reference: " + "; ".join(reasons),
                "floor_fwd_us": fwd_bytes / (copy_gbs * 1e9) * 1e6,
                "floor_fwdbwd_us": (fwd_bytes + bwd_bytes) / (copy_gbs * 1e9) * 1e6,
            }
            if reasons:
                print(f"WARNING {row['shape']} {variant}: {row['path']}", file=sys.stderr)
            if check:
                errors, row["torch_max_rel_err"] = _check(inp)
                row.update(errors)
                row["max_rel_err"] = max(errors.values())
                row["check"] = "ok" if row["max_rel_err"] <= bound else "FAIL"
                if row["check"] == "FAIL":
                    bad = ", ".join(f"{k[4:]} {v:.3g}" for k, v in errors.items() if v > bound)
                    print(
                        f"CHECK FAILED {row['shape']} {variant}: {bad} > {bound:g}",
                        file=sys.stderr,
                    )
            row.update(_measure(inp))
            for phase in ("fwd", "fwdbwd"):
                row[f"{phase}_x"] = row[f"torch_{phase}_us"] / row[f"ours_{phase}_us"]
                for who in ("ours", "torch"):
                    pct = 100 * row[f"floor_{phase}_us"] / row[f"{who}_{phase}_us"]
                    row[f"{who}_{phase}_%copy"] = pct
            row["copy_GBs"] = copy_gbs
            rows.append(row)
            del inp
            torch.cuda.empty_cache()
    return rows


def _host_rows(dtype, variants) -> list[dict]:
    """Per-call time of a call too small to keep the GPU busy: the host's cost of each."""
    rows = []
    for variant in variants:
        inp = _inputs(HOST_SHAPE, dtype, VARIANTS[variant])
        row = {"timing": "pipelined", "shape": "x".join(map(str, HOST_SHAPE)), "variant": variant}
        row.update(_measure(inp, _time_pipelined))
        row["fwd_x"] = row["torch_fwd_us"] / row["ours_fwd_us"]
        row["fwdbwd_x"] = row["torch_fwdbwd_us"] / row["ours_fwdbwd_us"]
        rows.append(row)
    return rows


def _shown(row: dict) -> dict:
    """``row`` with its errors as 1.2e-04 (print_table writes floats with 3 decimals)."""
    return {k: f"{v:.1e}" if "rel_err" in k else v for k, v in row.items()}


def _resnet50_row(rows: list[dict], batch: int) -> dict | None:
    """The network's sum over its fused batch norms, or None when a shape was not timed."""
    timed = {(r["C"], r["S"], r["variant"]): r for r in rows}
    if not set(RESNET50) <= set(timed):
        return None
    row = {"shape": f"resnet50 b{batch}", "variant": f"{sum(RESNET50.values())} bn layers"}
    for key in ("torch_fwd_us", "ours_fwd_us", "torch_fwdbwd_us", "ours_fwdbwd_us"):
        row[key] = sum(n * timed[k][key] for k, n in RESNET50.items())
    row["fwd_x"] = row["torch_fwd_us"] / row["ours_fwd_us"]
    row["fwdbwd_x"] = row["torch_fwdbwd_us"] / row["ours_fwdbwd_us"]
    row["saved_fwdbwd_ms"] = (row["torch_fwdbwd_us"] - row["ours_fwdbwd_us"]) / 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help="CxS or NxCxHxW, comma-separated, or 'all' (ResNet-50's 12, and its sum)",
    )
    p.add_argument("--batch", type=int, default=128, help="N of CxS shapes")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--variants", default="relu,add_relu", help="of: relu, add_relu")
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare ours with torch's outputs before timing (default on)",
    )
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    try:
        shapes = _parse_shapes(args.shapes, args.batch)
    except ValueError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        print("bench_batch_norm_act: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (r+w)")
    rows = _rows(shapes, getattr(torch, args.dtype), variants, args.check, copy_gbs)
    append_csv("batch_norm_act", rows)
    host = _host_rows(getattr(torch, args.dtype), variants)
    append_csv("batch_norm_act", host)
    cols = ["shape", "variant", "floor_fwd_us", "torch_fwd_us", "ours_fwd_us", "fwd_x"]
    cols += ["torch_fwd_%copy", "ours_fwd_%copy", "floor_fwdbwd_us", "torch_fwdbwd_us"]
    cols += ["ours_fwdbwd_us", "fwdbwd_x", "torch_fwdbwd_%copy", "ours_fwdbwd_%copy"]
    if args.check:
        cols += ["max_rel_err", "torch_max_rel_err", "check"]
    print_table([_shown(r) for r in rows], cols)
    print(f"host-bound: {'x'.join(map(str, HOST_SHAPE))}, calls back to back (pipelined p50)")
    cols = ["variant", "torch_fwd_us", "ours_fwd_us", "fwd_x", "torch_fwdbwd_us"]
    print_table(host, [*cols, "ours_fwdbwd_us", "fwdbwd_x"])
    if any(r["path"] != "fused" for r in rows):
        print("WARNING: some rows timed the PyTorch reference, not the kernels (path column)")
    total = _resnet50_row(rows, args.batch)
    if total is not None:
        append_csv("batch_norm_act", [total])
        cols = ["shape", "variant", "torch_fwd_us", "ours_fwd_us", "fwd_x", "torch_fwdbwd_us"]
        print_table([total], [*cols, "ours_fwdbwd_us", "fwdbwd_x", "saved_fwdbwd_ms"])
    elif args.shapes == "all":
        print("ResNet-50 sum left out: it needs both variants (--variants relu,add_relu)")
    failed = [r for r in rows if r.get("check") == "FAIL"]
    if failed:
        print(f"CHECK FAILED in {len(failed)} of {len(rows)} rows (see err_* columns)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
