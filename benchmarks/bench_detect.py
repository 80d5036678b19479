"""Detection label assignment: aiak's batched ops vs the per-image loops of YOLOX and mmdet3d.

    python benchmarks/bench_detect.py [--only simota,fcos3d,e2e] [--reps 10]

Rows (one process, same inputs, baseline and op back to back; ``pipelined`` timing, i.e.
max(host, GPU) per call as in a training loop; the loops synchronise the host per image anyway):
- SimOTA, 8400 anchors (640x640, strides 8/16/32), 80 classes, B = 16 and 64, G = 12 and 50:
  YOLOX's get_assignments per image in fp32 (written out in tests/ops/test_simota.py) vs
  ``aiak.ops.simota_assign``. Target on the H100: >= 30x at B = 64.
- FCOS3D, 1600x928 (30,929 points over 5 levels), B = 8, G = 20 and 50: mmdet3d's
  _get_target_single per image with its host-built ``range(P)`` index (tests/ops/test_fcos3d.py)
  vs ``aiak.ops.fcos3d_targets``. Target: >= 300x.
- End to end: a YOLOX-style loss step (assignment + iou/obj/cls losses + backward), B = 64,
  G = 12: YOLOX's per-image loop (tests/examples/test_yolox_example.py) vs
  examples/yolox_loss_simota.py.
Rows go to benchmarks/results/detect.csv.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from _harness import append_csv, print_table, time_pipelined

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(fn, reps: int) -> float:
    return time_pipelined(fn, calls=3, reps=reps)[1]


def _simota_row(t, B: int, G: int, reps: int) -> dict:
    from aiak.ops import simota_assign

    inputs = [x.cuda() for x in t.scene(B, G, 80, 640, valid_p=1.0, seed=B + G)]
    gt, classes, valid, centers, strides, pred, cls, obj = inputs

    def loop() -> None:
        for b in range(B):
            keep = valid[b].nonzero().squeeze(1)  # YOLOX: num_gt = int(nlabel[b])
            t.yolox_get_assignments(
                gt[b, keep], classes[b, keep], centers, strides, pred[b], cls[b], obj[b],
                dtype=torch.float32,
            )  # fmt: skip

    def op() -> None:
        simota_assign(*inputs)

    base, ours = _ms(loop, reps), _ms(op, reps)
    return {"work": "simota", "B": B, "G": G, "points": centers.shape[0],
            "loop_ms": base, "op_ms": ours, "speedup": base / ours, "target": 30.0}  # fmt: skip


def simota_rows(reps: int) -> list[dict]:
    t = _load("simota_literal", ROOT / "tests" / "ops" / "test_simota.py")
    return [_simota_row(t, B, G, reps) for B in (16, 64) for G in (12, 50)]


def _fcos3d_row(t, G: int, reps: int) -> dict:
    points, strides, ranges, counts = t.grid(1600, 928, "cuda")
    g = tuple(x.cuda() for x in t.gts(8, G, 1600, 928, valid_p=1.0, seed=G))

    def loop() -> None:
        t.per_image_loop(points, counts, g)

    def op() -> None:
        t.op(points, strides, ranges, g)

    base, ours = _ms(loop, reps), _ms(op, reps)
    return {"work": "fcos3d", "B": 8, "G": G, "points": points.shape[0],
            "loop_ms": base, "op_ms": ours, "speedup": base / ours, "target": 300.0}  # fmt: skip


def fcos3d_rows(reps: int) -> list[dict]:
    t = _load("fcos3d_literal", ROOT / "tests" / "ops" / "test_fcos3d.py")
    return [_fcos3d_row(t, G, reps) for G in (20, 50)]


def e2e_rows(reps: int) -> list[dict]:
    t = _load("yolox_example_test", ROOT / "tests" / "examples" / "test_yolox_example.py")
    ex = t.example
    B, G, C, size = 64, 12, 80, 640
    centers, strides = ex.anchors_for(size, "cuda")
    head = ex.TinyHead(centers, strides, C).cuda()
    gen = torch.Generator().manual_seed(0)
    labels, feats = ex.batch(B, G, size, C, gen, "cuda")

    def loop() -> None:
        loss = t.yolox_loop_loss(head(feats), labels, centers, strides, torch.float32)
        loss.backward()

    def op() -> None:
        loss = ex.yolox_loss(head(feats), labels, centers, strides)["total"]
        loss.backward()

    base, ours = _ms(loop, reps), _ms(op, reps)
    return [
        {"work": "yolox loss step (fwd+bwd)", "B": B, "G": G, "points": centers.shape[0],
         "loop_ms": base, "op_ms": ours, "speedup": base / ours, "target": ""}
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="simota,fcos3d,e2e")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_detect.py needs a CUDA GPU")
    rows = []
    parts = set(args.only.split(","))
    if "simota" in parts:
        rows += simota_rows(args.reps)
    if "fcos3d" in parts:
        rows += fcos3d_rows(args.reps)
    if "e2e" in parts:
        rows += e2e_rows(args.reps)
    path = append_csv("detect", rows)
    print_table(rows, ["work", "B", "G", "points", "loop_ms", "op_ms", "speedup", "target"])
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
