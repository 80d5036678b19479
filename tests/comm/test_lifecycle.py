"""comm.shutdown / comm.exit_rank: a rank ends with no gloo thread left to race the exit.

Each case runs in a process of its own (it owns the default process group) with a time
limit. The hazard it guards against: a DDP model or hook state that still holds a gloo
group after ``destroy_process_group()`` keeps gloo's worker threads alive into the
interpreter's teardown (abort) or drops the last reference holding the GIL (deadlock).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

_PRELUDE = textwrap.dedent(
    """
    import gc, os, sys, tempfile, threading
    import torch, torch.distributed as dist
    from torch import nn
    from aiak import comm

    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
    comm.register(ddp, comm.nan_check(comm.fp16_compress(scale=10)), offload=True)
    for _ in range(3):
        ddp(torch.randn(5, 8)).square().mean().backward()
    assert any(t.name == "aiak-comm-hooks" for t in threading.enumerate())
    """
)


def _run(body: str) -> subprocess.CompletedProcess:
    code = _PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_shutdown_releases_everything_and_closes_the_model() -> None:
    out = _run(
        """
        hook = ddp._comm_hooks[0][1]
        comm.shutdown()
        comm.shutdown()  # idempotent
        assert not dist.is_initialized()
        assert not any(t.name == "aiak-comm-hooks" for t in threading.enumerate())
        states = [hook, hook.inner, hook.inner.inner]
        assert all(s._link is None and s._tail is None and not s._ready for s in states)
        try:
            ddp(torch.randn(5, 8))
        except RuntimeError as exc:
            assert "was shut down" in str(exc)
        else:
            raise AssertionError("a shut-down DDP model still ran")
        net(torch.randn(5, 8))  # the module itself is intact
        print("clean")
        """
    )
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_released_state_serves_a_new_process_group() -> None:
    # After shutdown the hook state (settings, statistics) goes on with a new group, as a
    # checkpointed one does.
    out = _run(
        """
        state = ddp._comm_hooks[0][1]
        steps = state.step
        comm.shutdown()
        dist.init_process_group("gloo", init_method=f"file://{store}2", rank=0, world_size=1)
        again = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
        comm.register(again, comm.nan_check(comm.fp16_compress(scale=10)), state=state)
        again(torch.randn(5, 8)).square().mean().backward()
        assert state.step == steps + 1, (steps, state.step)
        comm.shutdown()
        print("reused")
        """
    )
    assert out.returncode == 0 and "reused" in out.stdout, out.stdout + out.stderr[-3000:]


def test_exit_rank_flushes_and_ends_with_the_code() -> None:
    out = _run(
        """
        print("result written", flush=False)
        comm.exit_rank(3)
        print("never")
        """
    )
    assert out.returncode == 3, out.stderr[-3000:]
    assert "result written" in out.stdout and "never" not in out.stdout
