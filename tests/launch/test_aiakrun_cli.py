"""aiakrun's command line: hosts, flags -> variables, conflicts, --dry-run (no process starts)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import string
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak.launch import flags, run
from aiak.launch.run import Host, main, parse_hosts


def test_parse_hosts():
    assert parse_hosts(None, 4) == [Host("localhost", "127.0.0.1", 4)]
    assert parse_hosts("a:2,b=10.0.0.2:2", None) == [Host("a", "a", 2), Host("b", "10.0.0.2", 2)]
    assert parse_hosts("a:2,b:2", 3) == [Host("a", "a", 2), Host("b", "b", 1)]
    assert parse_hosts("a:2,b:2", 2) == [Host("a", "a", 2)]
    with pytest.raises(ValueError, match="more than the 4 slots"):
        parse_hosts("a:2,b:2", 5)
    with pytest.raises(ValueError, match="twice"):
        parse_hosts("a:2,a:2", None)
    with pytest.raises(ValueError, match="-np"):
        parse_hosts(None, None)
    with pytest.raises(ValueError, match="cannot read"):
        parse_hosts("a:x", None)


def _env(argv: list[str]) -> dict[str, str]:
    parser = run._parser()
    return flags.environment(parser.parse_args(argv))


def test_flags_map_to_variables():
    assert _env(["--fp16-compression", "--hierarchical-allreduce", "--nan-check"]) == {
        "AIAK_HIERARCHICAL_ALLREDUCE": "1",
        "AIAK_FP16_COMPRESSION": "1",
        "PERSEUS_ALLREDUCE_NANCHECK": "1",
    }
    assert _env(["--powersgd", "--powersgd-rank", "4", "--start-compress-iter", "10"]) == {
        "AIAK_POWERSGD_COMPRESSION": "1",
        "AIAK_MATRIX_APPROXIMATION_RANK": "4",
        "AIAK_START_COMPRESS_ITER": "10",
    }
    assert _env(["--fuse-optimizer", "--accumulate-n-steps", "4"]) == {
        "AIAK_FUSED_OPTIMIZER": "1",
        "PERSEUS_ACCUMULATE_N_STEPS": "4",
    }
    assert _env(["--dgc", "--compress-ratio", "0.01", "--warmup-coeff", "0.5", "0.2"]) == {
        "AIAK_DGC": "1",
        "AIAK_DGC_COMPRESS_RATIO": "0.01",
        "AIAK_DGC_WARMUP_COEFF": "0.5 0.2",
    }
    assert _env(["--dgc", "--clip-grad-func", "norm", "--clip-grad-func-params", "2"]) == {
        "AIAK_DGC": "1",
        "AIAK_CLIP_GRAD_FUNC": "norm",
        "AIAK_CLIP_GRAD_FUNC_PARAMS": "2.0",
    }
    assert _env(["--downsample-n-elements", "4", "--gradient-momentum", "0.9"]) == {
        "PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4",
        "PERSEUS_GRADIENT_MOMENTUM": "0.9",
    }
    assert _env(["--allreduce-streams", "2", "--allreduce-fusion", "8"]) == {
        "PERSEUS_ALLREDUCE_STREAMS": "2",
        "PERSEUS_ALLREDUCE_FUSION": "8",
    }
    assert _env(["--overlap-backward-and-step", "--clip-grad-func", "norm"]) == {
        "AIAK_OVERLAP_BACKWARD_AND_STEP": "1",
        "AIAK_CLIP_GRAD_FUNC": "norm",
    }
    assert _env([]) == {}


def test_rank_is_a_deprecated_spelling_of_powersgd_rank():
    args = run._parser().parse_args(["--powersgd", "--rank", "4"])
    assert flags.environment(args)["AIAK_MATRIX_APPROXIMATION_RANK"] == "4"
    assert flags.deprecations(args) == [
        "--rank is deprecated: it means --powersgd-rank (PowerSGD's rank)"
    ]
    args = run._parser().parse_args(["--powersgd", "--powersgd-rank", "4"])
    assert flags.deprecations(args) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fuse-optimizer", "--overlap-backward-and-step"], "cannot be combined"),
        (["--powersgd", "--fp16-compression"], "cannot be combined"),
        (["--rank", "2"], "--powersgd-rank needs --powersgd"),
        (["--gradient-momentum", "0.5"], "needs --downsample-n-elements"),
        (["--clip-grad-func", "norm"], "needs --dgc or --overlap-backward-and-step"),
        (["--compress-ratio", "0.01"], "--compress-ratio needs --dgc"),
        (["--dgc", "--fuse-optimizer"], "cannot be combined"),
        (["--dgc", "--hierarchical-allreduce"], "cannot be combined"),
    ],
)
def test_flag_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _env(argv)


def test_every_flag_is_available():
    assert [f.option for f in flags.FLAGS if not f.available] == []


def test_errors_stop_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_ALLREDUCE_DTYPE", "7")
    assert main(["-np", "2", "--gloo", "--", "python", "x.py"]) == 2
    assert "PERSEUS_ALLREDUCE_DTYPE must be 0, 1 or 2" in capsys.readouterr().err
    monkeypatch.delenv("PERSEUS_ALLREDUCE_DTYPE")
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "yes")
    assert main(["-np", "2", "--gloo", "--", "python", "x.py"]) == 2
    assert "AIAK_FUSED_OPTIMIZER must be 0 or 1" in capsys.readouterr().err
    monkeypatch.delenv("AIAK_FUSED_OPTIMIZER")
    monkeypatch.setenv("GLOO_TIMEOUT_SECONDS", "abc")
    assert main(["-np", "2", "--gloo", "--", "python", "x.py"]) == 2
    assert "GLOO_TIMEOUT_SECONDS must be a number of seconds" in capsys.readouterr().err
    monkeypatch.delenv("GLOO_TIMEOUT_SECONDS")
    assert main(["-np", "2", "--dgc", "--compress-ratio", "2", "--", "python", "x.py"]) == 2
    assert "AIAK_DGC_COMPRESS_RATIO must be a number in (0, 1]" in capsys.readouterr().err


def test_dry_run_two_hosts(capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7777")
    monkeypatch.setenv("PERSEUS_GLOO_NETWORK_INTERFACE", "eth1")
    monkeypatch.setenv("AIAK_BOOTED_PID", "1")  # a per-process mark: never forwarded
    monkeypatch.delenv("PYTHONPATH", raising=False)
    argv = ["-np", "6", "-H", "h1:4,h2:4", "--gloo", "--fp16-compression", "--dry-run"]
    assert main([*argv, "--", "python", "train.py", "--lr", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# h1 (4 processes)" and lines[2] == "# h2 (2 processes)"
    for rank, (host, line, nproc) in enumerate((("h1", lines[1], 4), ("h2", lines[3], 2))):
        argv = shlex.split(line)
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        remote = shlex.split(argv[4])
        assert remote[:4] == ["cd", str(run.os.getcwd()), "&&", "exec"]
        assert remote[4] == "env"
        assert "AIAK_FP16_COMPRESSION=1" in remote and "AIAK_AUTO=1" in remote
        assert "AIAK_BACKEND=gloo" in remote and "GLOO_SOCKET_IFNAME=eth1" in remote
        assert f"PYTHONPATH={run.SITE_DIR}" in remote
        assert not [a for a in remote if a.startswith("AIAK_BOOTED_PID")]
        assert "AIAK_LAUNCH_NOTICES_SAID=1" in remote  # the hosts' nodes do not repeat them
        i = remote.index("aiak.launch.run")  # each host runs aiakrun as its node
        assert remote[i - 1] == "-m"
        tail = remote[i + 1 :]
        assert "--nnodes=2" in tail and f"--nproc-per-node={nproc}" in tail
        # torch's static rendezvous: node ranks in -H order, the first host holds rank 0
        assert "--rdzv-backend=static" in tail and f"--node-rank={rank}" in tail
        assert "--master-addr=h1" in tail and "--master-port=7777" in tail
        assert f"--local-addr={host}" in tail and "--max-restarts=0" in tail
        assert tail[-5:] == ["--", "python", "train.py", "--lr", "0.1"]
    ids = {
        a for ln in (lines[1], lines[3]) for a in shlex.split(shlex.split(ln)[4]) if "rdzv-id" in a
    }
    assert len(ids) == 1  # one job id on both hosts


def test_dry_run_two_hosts_with_restarts_uses_c10d(capsys):
    argv = ["-H", "h1:1,h2:1", "--gloo", "--max-restarts", "2", "--dry-run"]
    assert main([*argv, "--", "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for i, line in enumerate((lines[1], lines[3])):
        tail = shlex.split(shlex.split(line)[4])
        assert "--rdzv-backend=c10d" in tail and "--rdzv-endpoint=h1:6666" in tail
        assert f"--rdzv-conf=is_host={int(i == 0)}" in tail and "--max-restarts=2" in tail


def test_dry_run_remote_shell_and_master_addr(capsys):
    argv = ["-H", "nsa=10.9.0.1:1,nsb=10.9.0.2:1", "--gloo", "--dry-run"]
    argv += ["--remote-shell", "ip netns exec {host} sh -c"]
    assert main([*argv, "--", "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    a = shlex.split(lines[1])
    assert a[:5] == ["ip", "netns", "exec", "nsa", "sh"] and a[5] == "-c"
    assert "--master-addr=10.9.0.1" in shlex.split(a[6])
    assert "--local-addr=10.9.0.2" in shlex.split(shlex.split(lines[3])[6])


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_exits_0_with_the_usage(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: aiakrun") and "--nproc-per-node" in out and "--dgc" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("aiak ") and "torch " in out


def test_perseusrun_is_the_same_launcher(capsys, monkeypatch):
    monkeypatch.setattr(run.sys, "argv", ["perseusrun", "--help"])
    assert run.perseusrun() == 0
    assert capsys.readouterr().out.startswith("usage: perseusrun")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rdzv-timeout", "-5"], "argument --rdzv-timeout: an integer >= 1, got '-5'"),
        (["--rdzv-timeout", "x"], "argument --rdzv-timeout"),
        (["-np", "0"], "argument -np/--num-proc: an integer >= 1"),
        (["--remote-shell", ""], "argument --remote-shell: must not be empty"),
        (["--remote-shell", "ssh"], "'ssh' has no {host}"),
        (["--remote-shell", "ssh {hots}"], "unknown field {hots}"),
        (["--remote-shell", "ssh {0}"], "unknown field {0}"),
        (["--remote-shell", "ssh {host"], "cannot read"),
        (["--remote-shell", "ssh '{host}"], "cannot split"),
        (["--nnodes", "0"], "argument --nnodes"),
        (["--nnodes", "3:2"], "argument --nnodes"),
        (["--node-rank", "-1"], "argument --node-rank"),
        (["--max-restarts", "-1"], "argument --max-restarts"),
        (["--master-port", "70000"], "argument --master-port"),
        (["--nproc-per-node", "0"], "argument --nproc-per-node"),
        (["--rdzv-endpoint", ":29400"], "argument --rdzv-endpoint"),
        (["--monitor-interval", "nan"], "argument --monitor-interval"),
        (["--python", ""], "argument --python"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    assert main(["-np", "1", *argv, "--dry-run", "--", "python", "x.py"]) == 2
    assert message in capsys.readouterr().err


@given(st.text(min_size=1, max_size=30))
@settings(max_examples=60)
def test_remote_shell_accepts_exactly_the_host_field(text):
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        shlex.split(text.format(host="h"))
    except (ValueError, KeyError, IndexError):
        fields = None
    try:
        run._remote_shell(text)
    except argparse.ArgumentTypeError:
        assert fields != {"host"} or not text.strip()
    else:
        assert fields == {"host"}


def test_no_command(capsys):
    assert main(["-np", "2", "--gloo"]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert main(["-np", "2", "--gloo", "--"]) == 2
    assert "no command to run" in capsys.readouterr().err


def test_command_without_double_dash_like_torchrun(capsys):
    args = run._parse(run._parser(), ["-np", "2", "python", "train.py", "--lr", "1", "-np", "3"])
    assert args.np == 2 and args.command == ["python", "train.py", "--lr", "1", "-np", "3"]


def test_missing_program_is_named(capsys):
    assert main(["-np", "1", "--gloo", "--", "/nonexistent/cmd", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "aiakrun: cannot run '/nonexistent/cmd': it does not exist"
    )
    assert main(["-np", "1", "--gloo", "--", "no-such-program-aiak", "x"]) == 2
    assert "'no-such-program-aiak': it is not on PATH" in capsys.readouterr().err


def test_a_py_script_runs_under_python(capsys):
    assert main(["-np", "2", "--gloo", "--dry-run", "--python", sys.executable, "--", "t.py"]) == 0
    last = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert last[-3:] == ["--no-python", sys.executable, "t.py"]


def test_python_without_aiak_is_refused_before_the_launch(tmp_path, capsys):
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other is None or os.path.realpath(other) == os.path.realpath(sys.executable):
        pytest.skip("no second python on this machine")
    probe = subprocess.run([other, "-c", "import aiak"], capture_output=True, timeout=60)
    if probe.returncode == 0:
        pytest.skip(f"{other} imports aiak")
    assert main(["-np", "1", "--gloo", "--", other, "x.py"]) == 2
    err = capsys.readouterr().err
    assert f"{other} (the command's python) cannot import aiak" in err


def test_python_without_aiak_stops_at_start_up():
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other is None or os.path.realpath(other) == os.path.realpath(sys.executable):
        pytest.skip("no second python on this machine")
    env = {"PATH": "/usr/bin:/bin", "AIAK_AUTO": "1", "PYTHONPATH": run.SITE_DIR}
    out = subprocess.run(
        [other, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=60
    )
    if "ran" in out.stdout and out.returncode == 0:
        pytest.skip(f"{other} imports aiak")
    assert out.returncode == 1 and "ran" not in out.stdout
    assert f"AIAK_AUTO=1, but {other} cannot import aiak" in out.stderr
    assert "Error in sitecustomize" not in out.stderr


def test_nccl_without_nccl_is_refused(capsys):
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    assert main(["-np", "1", "--nccl", "--dry-run", "--", "python", "x.py"]) == 2
    assert "--nccl: this torch is built without NCCL" in capsys.readouterr().err


def _torch_args(argv: list[str]) -> list[str]:
    args = run._parse(run._parser(), [*argv, "--", "python", "x.py"])
    return run.torchrun_args(args, run._nproc_of(args))


def test_torchrun_options_pass_through():
    got = _torch_args(["--nproc-per-node", "4"])  # nothing of torchrun's: a local c10d
    assert got[:2] == ["--nproc-per-node=4", "--max-restarts=0"]
    assert "--nnodes=1" in got and "--rdzv-backend=c10d" in got
    assert "--rdzv-conf=join_timeout=300" in got
    assert [a for a in got if a.startswith("--rdzv-endpoint=127.0.0.1:")]
    got = _torch_args(
        [
            "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "job",
            "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-timeout", "60",
        ]
    )  # fmt: skip
    assert got == [
        "--nproc-per-node=8",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400",
        "--rdzv-id=job",
        "--rdzv-conf=join_timeout=60",
    ]
    got = _torch_args(["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                       "--master-addr", "h", "--master-port", "29500"])  # fmt: skip
    assert "--rdzv-conf=timeout=300" in got  # torch's static rendezvous (torchrun's default)
    assert "--master-addr=h" in got and "--master-port=29500" in got
    got = _torch_args(["--standalone", "-np", "2"])
    assert "--standalone" in got and not [a for a in got if a.startswith("--rdzv-conf")]
    got = _torch_args(["-np", "2", "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=5"])
    assert "--rdzv-conf=join_timeout=5" in got  # the user's own value stays


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-H", "a:1,b:1", "--nnodes", "2"], "-H starts every host itself; --nnodes"),
        (["-np", "4", "--nnodes", "2"], "give each node's count as --nproc-per-node"),
        (["-np", "4", "--nproc-per-node", "2"], "disagree"),
        (["--nnodes", "2"], "give -np N or --nproc-per-node N"),
        (["-H", "localhost:2", "--nproc-per-node", "2"], "each host's slots"),
    ],
)
def test_launch_shape_errors(argv, message, capsys):
    assert main([*argv, "--gloo", "--dry-run", "--", "python", "x.py"]) == 2
    assert message in capsys.readouterr().err


def test_a_hosts_node_does_not_repeat_the_notices(capsys, monkeypatch):
    monkeypatch.setenv(run.SAID, "1")
    argv = ["-np", "2", "--gloo", "--dry-run", "--accumulate-n-steps", "4"]
    assert main([*argv, "--", "python", "x.py"]) == 0
    assert capsys.readouterr().err == ""


def test_silent_settings_warn_once_at_start_up(capsys):
    argv = ["-np", "2", "--gloo", "--dry-run", "--accumulate-n-steps", "4", "--powersgd"]
    argv += ["--hierarchical-allreduce", "--rank", "2"]
    assert main([*argv, "--", "python", "x.py"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4, err
    assert "--rank is deprecated" in err[0]
    assert "PERSEUS_ACCUMULATE_N_STEPS" in err[1] and "aiak.comm.accumulate" in err[1]
    assert "PowerSGD compresses from step 1000" in err[2]
    assert "(--hierarchical-allreduce) on one node is a flat allreduce" in err[3]
