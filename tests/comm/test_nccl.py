"""aiak.comm hooks on NCCL across 2 GPUs: one-step gradients against DDP without a hook.

Runs benchmarks/bench_comm_nccl.py in its short form under torchrun; the script exits 1 when a
hook's averaged gradients miss their tolerance (fp32 1e-6, fp16 2e-3, bf16 2e-2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, has {torch.cuda.device_count()}")
    return dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )


def _torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``script`` under torch.distributed.run on 2 GPUs (skips with fewer)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT
    )


@pytest.mark.cuda
@pytest.mark.distributed
def test_hooks_on_nccl_match_ddp_without_hook() -> None:
    # "--csv ''": a smoke run, its timings are not results
    out = _torchrun(
        ROOT / "benchmarks" / "bench_comm_nccl.py", "--layers", "2", "--steps", "3", "--csv", ""
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "aiak fp16 (scale 10)" in out.stdout and "FAIL" not in out.stdout


@pytest.mark.cuda
@pytest.mark.distributed
def test_dgc_on_nccl_equals_dgc_on_gloo_cpu() -> None:
    # The decode runs in a callback of NCCL's futures: it must see the allgather's output.
    out = _torchrun(ROOT / "tests" / "comm" / "_dgc_nccl_worker.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count(": OK") == 2, out.stdout[-3000:]
