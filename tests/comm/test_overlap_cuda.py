"""overlap_step on one GPU (NCCL, world 1): steps on aiak's worker thread and a side stream."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cuda
def test_overlap_step_on_a_gpu_matches_the_plain_loop() -> None:
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    out = subprocess.run(
        [sys.executable, str(HERE / "_overlap_cuda_worker.py"), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parents[1],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("sgd", "adam"):
        for mode in ("offload", "inline"):
            assert r[f"{name}_{mode}"] < 1e-6, (name, mode, r)
            assert r[f"{name}_{mode}_steps"] >= 6, (name, mode, r)
