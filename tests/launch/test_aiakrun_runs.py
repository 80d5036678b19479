"""aiakrun for real on CPU (gloo): a plain DDP script trains with aiak's hook, a killed rank
fails the job, a slowed rank is reported."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import AIAKRUN, HERE, ROOT, clean_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PLAIN = ROOT / "examples" / "ddp_plain.py"


def _bytes(out: str) -> set[int]:
    return {int(b) for b in re.findall(r"\[aiak rank 0\] step \d+: sent (\d+) B intra", out)}


def test_plain_script_trains_with_fp16_hook_and_half_the_bytes():
    assert "aiak" not in PLAIN.read_text().lower()
    argv = [*AIAKRUN, "-np", "4", "--gloo", "--comm-log-steps", "10"]
    cmd = ["--", sys.executable, str(PLAIN), "--steps", "30"]
    fp16 = run([*argv, "--fp16-compression", *cmd], clean_env())
    assert fp16.returncode == 0, fp16.stdout[-4000:]
    assert "DDP registered aiak_cast" in fp16.stdout
    grads = int(re.search(r"\((\d+) B of gradients per step, 25 MiB buckets\)", fp16.stdout)[1])
    loss = re.search(r"optimizer AdamW loss ([\d.]+) -> ([\d.]+)", fp16.stdout)
    assert float(loss[2]) < 0.5 * float(loss[1])
    # torch's allreduce through aiak's plain hook, same script, same logging
    fp32 = run([*argv, *cmd], clean_env())
    assert fp32.returncode == 0, fp32.stdout[-4000:]
    ring = 2 * 3 * grads // 4  # a ring allreduce over 4 ranks sends 2(N-1)/N of the buffer
    assert _bytes(fp32.stdout) == {ring}
    assert _bytes(fp16.stdout) == {ring // 2}


def test_fused_optimizer_flag_swaps_the_scripts_optimizer():
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--fuse-optimizer"]
    out = run([*argv, "--", sys.executable, str(PLAIN), "--steps", "10"], clean_env())
    assert out.returncode == 0, out.stdout[-4000:]
    assert "optim: torch.optim.AdamW built as aiak FusedAdamW" in out.stdout
    assert "optimizer FusedAdamW loss" in out.stdout


def test_dgc_flag_trains_a_plain_sgd_script_as_sgd_with_momentum(tmp_path):
    # compress ratio 1 sends every gradient: DGC's momentum in the hook plus DGCSGD's on weight
    # decay is then exactly torch's SGD with momentum, so the linked momentum (0.5, not DGC's
    # default 0.9) must reproduce the run without aiak
    cmd = [sys.executable, str(PLAIN), "--steps", "12", "--sgd", "0.5", "--save"]
    plain = run([*AIAKRUN, "-np", "2", "--gloo", "--", *cmd, str(tmp_path / "a.pt")], clean_env())
    assert plain.returncode == 0, plain.stdout[-4000:]
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--dgc", "--compress-ratio", "1"]
    dense = run([*argv, "--", *cmd, str(tmp_path / "b.pt")], clean_env())
    assert dense.returncode == 0, dense.stdout[-4000:]
    assert "torch.optim.SGD built as aiak DGCSGD" in dense.stdout
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert (a["optimizer"], b["optimizer"]) == ("SGD", "DGCSGD")
    for pa, pb in zip(a["params"], b["params"]):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)
    # sparse: 1% of every weight matrix per step. Measured over 60 steps: loss 1.009 -> 0.749
    # (torch's SGD: -> 0.648) with 12,240 B sent per step against 340,008 for the dense ring.
    argv[-1] = "0.01"
    cmd[cmd.index("12")] = "60"
    sparse = run([*argv, "--comm-log-steps", "20", "--", *cmd[:-1]], clean_env())
    assert sparse.returncode == 0, sparse.stdout[-4000:]
    loss = re.search(r"optimizer DGCSGD loss ([\d.]+) -> ([\d.]+)", sparse.stdout)
    assert loss and float(loss[2]) < 0.8 * float(loss[1]), sparse.stdout[-2000:]
    # DGC's DDP gets 50 MiB buckets (aiak.comm.DGC_BUCKET_MB), the fp16 hook's DDP its own 25
    dense_ring = int(
        re.search(r"\((\d+) B of gradients per step, 50 MiB buckets\)", sparse.stdout)[1]
    )
    assert _bytes(sparse.stdout) and max(_bytes(sparse.stdout)) < dense_ring / 20


def test_dgc_flag_refuses_a_script_without_sgd():
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--dgc", "--", sys.executable, str(PLAIN)]
    out = run([*argv, "--steps", "3"], clean_env())
    assert out.returncode != 0
    assert "no SGD optimizer was linked to it" in out.stdout, out.stdout[-4000:]


def test_a_killed_rank_fails_the_launch():
    out = run(
        [*AIAKRUN, "-np", "2", "--gloo", "--", sys.executable, str(HERE / "_die.py")],
        clean_env(),
        limit=180,
    )
    assert out.returncode == 1, out.stdout[-4000:]
    assert "Signal 9 (SIGKILL) received by PID" in out.stdout


def _initial_params() -> list[torch.Tensor]:
    """examples/ddp_plain.py's model as built (torch.manual_seed(0))."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return [p.detach().clone() for p in model.parameters()]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x - y).square().sum()) for x, y in zip(a, b)) ** 0.5


def test_overlap_flag_steps_an_unchanged_script_during_backward(tmp_path):
    # the overlap steps each bucket's parameters with the same averaged gradient the script's
    # own step() would use, and the script's step() does nothing: the same parameters
    cmd = [sys.executable, str(PLAIN), "--steps", "8", "--save"]
    argv = [*AIAKRUN, "-np", "2", "--gloo"]
    plain = run([*argv, "--", *cmd, str(tmp_path / "a.pt")], clean_env())
    assert plain.returncode == 0, plain.stdout[-4000:]
    over = run(
        [*argv, "--overlap-backward-and-step", "--", *cmd, str(tmp_path / "b.pt")], clean_env()
    )
    assert over.returncode == 0, over.stdout[-4000:]
    assert "comm: AdamW steps during backward, bucket by bucket" in over.stdout
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert _distance(a["params"], _initial_params()) > 0.1  # it trained
    for pa, pb in zip(a["params"], b["params"]):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)


def test_overlap_flag_with_gradient_clipping(tmp_path):
    # SGD (lr 0.05, momentum 0.9, weight decay 1e-4) with every gradient's global norm clipped
    # to 0.01: 8 steps move the parameters by at most lr * sum of the momentum buffers' norms
    # <= 0.05 * 8 * (0.01 + 1e-4 * |p|) / (1 - 0.9); unclipped they move much further
    cmd = [sys.executable, str(PLAIN), "--steps", "8", "--sgd", "0.9", "--save"]
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--overlap-backward-and-step"]
    clipped = run(
        [*argv, "--clip-grad-func", "norm", "--clip-grad-func-params", "0.01", "--", *cmd,
         str(tmp_path / "c.pt")],
        clean_env(),
    )  # fmt: skip
    assert clipped.returncode == 0, clipped.stdout[-4000:]
    assert "(clipping: norm {'max_norm': 0.01})" in clipped.stdout
    free = run([*argv, "--", *cmd, str(tmp_path / "f.pt")], clean_env())
    assert free.returncode == 0, free.stdout[-4000:]
    start = _initial_params()
    size = sum(float(p.square().sum()) for p in start) ** 0.5
    bound = 0.05 * 8 * (0.01 + 1e-4 * 1.1 * size) / (1 - 0.9)
    moved = _distance(torch.load(tmp_path / "c.pt")["params"], start)
    assert 0 < moved <= bound, (moved, bound)
    assert _distance(torch.load(tmp_path / "f.pt")["params"], start) > 3 * bound


def test_slow_rank_is_reported_on_rank_0():
    env = clean_env(SLOW_RANK="2", SLOW_SECONDS="0.05", STEPS="13")
    argv = [*AIAKRUN, "-np", "3", "--gloo", "--perf-check-n-steps", "4"]
    out = run([*argv, "--", sys.executable, str(HERE / "_slow.py")], env)
    assert out.returncode == 0, out.stdout[-4000:]
    found = re.findall(
        r"\[aiak rank 0\] perf check, steps \d+\.\.\d+: rank (\d+) \((.+?)\) is "
        r"(\d+)% slower",
        out.stdout,
    )
    assert found, out.stdout[-4000:]
    assert {r for r, _, _ in found} == {"2"}
    assert all(int(p) > 100 and "CPU" in where for _, where, p in found)
    # the slow rank tells its own host too
    assert re.search(r"\[aiak rank 2\] perf check, steps \d+\.\.\d+: rank 2 ", out.stdout)


def test_overlap_flag_with_dgc_steps_as_dgc_alone(tmp_path):
    # the overlap steps DGCSGD bucket by bucket with DGC's own exchanged gradient: the same
    # parameters as --dgc with the script's step()
    cmd = [sys.executable, str(PLAIN), "--steps", "8", "--sgd", "0.9", "--save"]
    argv = [*AIAKRUN, "-np", "2", "--gloo", "--dgc", "--compress-ratio", "0.01"]
    alone = run([*argv, "--", *cmd, str(tmp_path / "a.pt")], clean_env())
    assert alone.returncode == 0, alone.stdout[-4000:]
    over = run(
        [*argv, "--overlap-backward-and-step", "--", *cmd, str(tmp_path / "b.pt")], clean_env()
    )
    assert over.returncode == 0, over.stdout[-4000:]
    assert "comm: DGCSGD steps during backward, bucket by bucket" in over.stdout
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert (a["optimizer"], b["optimizer"]) == ("DGCSGD", "DGCSGD")
    assert _distance(a["params"], _initial_params()) > 0.01  # it trained
    for pa, pb in zip(a["params"], b["params"]):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)
