"""A tiny driver for compute-sanitizer: each detection kernel on small padded batches (a 0-gt
image, padding, an A not a multiple of the block), checked against the reference.

    compute-sanitizer --tool memcheck python scripts/detect_sanitize.py
    compute-sanitizer --tool racecheck python scripts/detect_sanitize.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    s = _load("simota_t", ROOT / "tests" / "ops" / "test_simota.py")
    f = _load("fcos3d_t", ROOT / "tests" / "ops" / "test_fcos3d.py")
    for mode in s.MODES.values():
        inputs = list(s.scene(3, 5, 7, 96, valid_p=0.7, seed=1))
        inputs[2][1] = False  # an image without gts
        ref = s.simota_assign(*inputs, **mode)
        out = s.simota_assign(*(t.cuda() for t in inputs), **mode)
        s.assert_same(out, tuple(ref))
    points, strides, ranges, _ = f.grid(200, 120)
    g = list(f.gts(3, 6, 200, 120, valid_p=0.7, seed=2))
    g[-1][1] = False
    ref = f.op(points, strides, ranges, tuple(g))
    out = f.op(points.cuda(), strides.cuda(), ranges.cuda(), tuple(t.cuda() for t in g))
    f.assert_same(out, ref, exact_float=False)
    torch.cuda.synchronize()
    print("detect kernels: ok")


if __name__ == "__main__":
    main()
