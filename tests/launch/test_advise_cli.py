"""aiak-advise's command line: bad input, a failing script, a script that outlives --limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import clean_env, run

from aiak.launch import advise

ADVISE = [sys.executable, "-m", "aiak.launch.advise"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "1", "python", "x.py"], "put the command after '--'"),
        (["--steps", "0", "--", "python", "x.py"], "--steps must be >= 1"),
        (["--warmup-steps", "1", "--", "python", "x.py"], "--warmup-steps must be >= 2"),
        (["--seconds", "-1", "--", "python", "x.py"], "--seconds must be a positive number"),
        (["--limit", "0", "--", "python", "x.py"], "--limit must be a positive number"),
        (["-np", "1", "--"], "no command after '--'"),
        (["--dgc", "--fuse-optimizer", "--", "python", "x.py"], "cannot be combined"),
        (["--compress-ratio", "0.1", "--", "python", "x.py"], "--compress-ratio needs --dgc"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    assert advise.main(argv) == 2
    assert message in capsys.readouterr().err


def test_features_on_reads_flags_and_environment():
    on = advise.features_on(["-np", "2", "--gloo", "--fp16-compression"], {"AIAK_X": "1"})
    assert on == {"AIAK_X": "1", "AIAK_FP16_COMPRESSION": "1"}
    assert advise.features_on(["-np", "2"], {"HOME": "/"}) == {}


@pytest.mark.slow
def test_a_failing_script_is_a_clear_error_with_its_output(tmp_path):
    # a sitecustomize of the user's on PYTHONPATH still runs (the start-up hooks chain to it)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('user sitecustomize ran', flush=True)\n")
    code = "import torch; print('before the error', flush=True); raise RuntimeError('boom 38')"
    argv = [*ADVISE, "--limit", "300", "-np", "1", "--gloo", "--", sys.executable, "-c", code]
    out = run(argv, clean_env(PYTHONPATH=str(site)), limit=400)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "aiak-advise: the script failed (aiakrun exit 1); its output:" in out.stdout
    assert "before the error" in out.stdout and "RuntimeError: boom 38" in out.stdout
    assert "user sitecustomize ran" in out.stdout


@pytest.mark.slow
def test_a_script_without_torch_reports_nothing_and_says_so():
    argv = [*ADVISE, "-np", "1", "--gloo", "--", sys.executable, "-c", "print('no torch')"]
    out = run(argv, clean_env(), limit=300)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "no rank reported" in out.stdout and "no torch" in out.stdout


@pytest.mark.slow
def test_a_hanging_script_is_killed_at_the_limit(tmp_path):
    pid_file = tmp_path / "pid"
    code = (
        "import os, time, torch; "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    )
    argv = [*ADVISE, "--limit", "25", "-np", "1", "--gloo", "--", sys.executable, "-c", code]
    t0 = time.monotonic()
    out = run(argv, clean_env(), limit=300)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout[-3000:]
    assert "outlived --limit 25 s and was killed" in out.stdout
    assert took < 200  # the limit, the launcher's grace and the kill; not the script's hour
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pid), f"worker {pid} outlived aiak-advise"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return not state.stdout.strip().startswith("Z")  # a zombie is dead, waiting to be reaped


def _fake_reports(step_ms: float) -> list[dict]:
    rec = dict.fromkeys(("data", "data_epoch_start", "forward", "backward", "comm"), 0.0)
    rec.update(optimizer=step_ms * 1e-3 / 2, forward=step_ms * 1e-3 / 2, step=step_ms * 1e-3)
    return [{"rank": 0, "records": [rec] * 5, "facts": {}, "ops": {}, "op_cost_s": 0.0}]


def _advice(feature: str, gain: float | None, **kw) -> advise.model.Advice:
    return advise.model.Advice(feature, True, "comm", gain, "why", "use", "not", **kw)


def test_verify_runs_the_first_advice_that_can_be_switched_on(monkeypatch):
    calls = []

    def fake_measure(aiakrun_args, command, *args, trial=None, **kw):
        calls.append((list(aiakrun_args), trial))
        return _fake_reports(60.0), ""

    monkeypatch.setattr(advise, "measure", fake_measure)
    ns = advise._parser().parse_args(["--steps", "5"])
    ns.warmup_steps, ns.seconds, ns.limit = 3, None, 100.0
    before = advise.model.breakdown(_fake_reports(100.0))
    advice = [
        _advice("outside", 0.05),  # a code change aiak-advise cannot make: skipped
        _advice("PowerSGD (rank 2)", 0.04, flags=("--powersgd", "--rank", "2")),
    ]
    result, after = advise._verify(ns, ["-np", "2"], ["python", "t.py"], before, advice)
    # PowerSGD's trial compresses from step 2 so that the measured steps are compressed
    assert calls == [
        (["--powersgd", "--rank", "2", "--start-compress-iter", "2", "-np", "2"], None)
    ]
    assert result["before_s"] == pytest.approx(0.1) and result["after_s"] == pytest.approx(0.06)
    assert result["predicted_s"] == pytest.approx(0.06)
    assert result["measured_over_predicted"] == pytest.approx(1.0)
    assert after is not None and after.step == pytest.approx(0.06)
    text = advise.report._verify_lines(result)
    assert "before 100.0 ms per step, after 60.0 ms: x1.67" in text[1]
    assert "measured / predicted step 1.00" in text[1]


def test_verify_of_a_code_line_feature_runs_its_trial(monkeypatch):
    calls = []

    def fake_measure(aiakrun_args, command, *args, trial=None, **kw):
        calls.append((list(aiakrun_args), trial))
        return _fake_reports(50.0), ""

    monkeypatch.setattr(advise, "measure", fake_measure)
    ns = advise._parser().parse_args([])
    ns.steps, ns.warmup_steps, ns.seconds, ns.limit = 5, 3, None, 100.0
    before = advise.model.breakdown(_fake_reports(100.0))
    advice = [_advice("CrossEpochLoader", None, trial="cross-epoch-loader")]
    result, _ = advise._verify(ns, ["-np", "1"], ["python", "t.py"], before, advice)
    assert calls == [(["-np", "1"], "cross-epoch-loader")]
    assert "applied for this run by the probe" in result["how"]
    assert "no prediction" in advise.report._verify_lines(result)[1]


def test_verify_refuses_flags_that_conflict_with_the_runs_own(monkeypatch):
    monkeypatch.setattr(advise, "measure", lambda *a, **k: pytest.fail("must not run"))
    ns = advise._parser().parse_args([])
    before = advise.model.breakdown(_fake_reports(100.0))
    advice = [_advice("fp16 gradient compression", 0.05, flags=("--fp16-compression",))]
    result, after = advise._verify(ns, ["--dgc"], ["python", "t.py"], before, advice)
    assert after is None and "cannot be combined" in result["skipped"]


def test_aiakrun_advise_hands_the_job_to_aiak_advise(capsys):
    from aiak.launch import run as aiakrun

    assert aiakrun.main(["--advise", "--steps", "0", "--", "python", "x.py"]) == 2
    assert "aiak-advise: error: --steps must be >= 1" in capsys.readouterr().err
    # after '--' the flag belongs to the user's command: aiakrun parses it as usual
    assert aiakrun.main(["--dry-run", "-np", "1", "--", "python", "x.py", "--advise"]) == 0


def test_verify_of_a_trial_the_probe_could_not_apply_is_skipped_with_its_reason(monkeypatch):
    def fake_measure(aiakrun_args, command, *args, trial=None, **kw):
        reports = _fake_reports(50.0)
        reports[0]["facts"] = {"trials": {trial: "not applied: the model is wrapped in DDP"}}
        return reports, ""

    monkeypatch.setattr(advise, "measure", fake_measure)
    ns = advise._parser().parse_args([])
    ns.steps, ns.warmup_steps, ns.seconds, ns.limit = 5, 3, None, 100.0
    before = advise.model.breakdown(_fake_reports(100.0))
    advice = [_advice("O2 mixed precision", 0.01, trial="o2")]
    result, after = advise._verify(ns, ["-np", "1"], ["python", "t.py"], before, advice)
    assert after is None
    assert result == {"skipped": "O2 mixed precision: not applied: the model is wrapped in DDP"}


_O2_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 8), torch.randn(16, 1)
for _ in range(40):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("trial", [None, "o2"])
def test_the_o2_trial_runs_the_unchanged_script_decorated(tmp_path, monkeypatch, trial):
    script = tmp_path / "train.py"
    script.write_text(_O2_SCRIPT)
    for k in [k for k in os.environ if k.startswith(("AIAK_", "PERSEUS_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reports, _ = advise.measure(
        ["-np", "1"], [sys.executable, str(script)], steps=3, warmup=2, limit=240, trial=trial
    )
    facts = reports[0]["facts"]
    assert facts["optimizer"]["aiak_o2"] == (trial == "o2")
    assert facts.get("trials", {}) == ({"o2": "applied"} if trial else {})
    # decorated, the model runs in half: its weights are no longer cast in the forward
    assert (reports[0]["amp"]["forward"][1] == 0) == (trial == "o2")
