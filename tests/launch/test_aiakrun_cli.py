"""aiakrun's command line: hosts, flags -> variables, conflicts, --dry-run (no process starts)."""

from __future__ import annotations

import shlex

import pytest

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
    assert _env(["--powersgd", "--rank", "4", "--start-compress-iter", "10"]) == {
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
    assert _env([]) == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fuse-optimizer", "--overlap-backward-and-step"], "cannot be combined"),
        (["--powersgd", "--fp16-compression"], "cannot be combined"),
        (["--rank", "2"], "--rank needs --powersgd"),
        (["--clip-grad-func", "norm"], "needs --dgc or --overlap-backward-and-step"),
        (["--compress-ratio", "0.01"], "--compress-ratio needs --dgc"),
        (["--dgc", "--fuse-optimizer"], "cannot be combined"),
        (["--dgc", "--hierarchical-allreduce"], "cannot be combined"),
        (["--overlap-backward-and-step"], "not available in this version"),
    ],
)
def test_flag_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _env(argv)


def test_the_only_unavailable_flag_is_the_overlap():
    assert {f.option for f in flags.FLAGS if not f.available} == {"--overlap-backward-and-step"}


def test_errors_stop_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_ALLREDUCE_DTYPE", "7")
    assert main(["-np", "2", "--gloo", "--", "python", "x.py"]) == 2
    assert "PERSEUS_ALLREDUCE_DTYPE must be 0, 1 or 2" in capsys.readouterr().err
    monkeypatch.delenv("PERSEUS_ALLREDUCE_DTYPE")
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "yes")
    assert main(["-np", "2", "--gloo", "--", "python", "x.py"]) == 2
    assert "AIAK_FUSED_OPTIMIZER must be 0 or 1" in capsys.readouterr().err
    monkeypatch.delenv("AIAK_FUSED_OPTIMIZER")
    assert main(["-np", "2", "--gloo", "python", "x.py"]) == 2
    assert "after '--'" in capsys.readouterr().err
    assert main(["-np", "2", "--overlap-backward-and-step", "--", "python", "x.py"]) == 2
    assert "not available" in capsys.readouterr().err
    assert main(["-np", "2", "--dgc", "--compress-ratio", "2", "--", "python", "x.py"]) == 2
    assert "AIAK_DGC_COMPRESS_RATIO must be a number in (0, 1]" in capsys.readouterr().err


def test_dry_run_two_hosts(capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7777")
    monkeypatch.setenv("PERSEUS_GLOO_NETWORK_INTERFACE", "eth1")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    argv = ["-np", "6", "-H", "h1:4,h2:4", "--gloo", "--fp16-compression", "--dry-run"]
    assert main([*argv, "--", "python", "train.py", "--lr", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# h1 (4 processes)" and lines[2] == "# h2 (2 processes)"
    for host, line, nproc in (("h1", lines[1], 4), ("h2", lines[3], 2)):
        argv = shlex.split(line)
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        remote = shlex.split(argv[4])
        assert remote[:4] == ["cd", str(run.os.getcwd()), "&&", "exec"]
        assert remote[4] == "env"
        assert "AIAK_FP16_COMPRESSION=1" in remote and "AIAK_AUTO=1" in remote
        assert "AIAK_BACKEND=gloo" in remote and "GLOO_SOCKET_IFNAME=eth1" in remote
        assert f"PYTHONPATH={run.SITE_DIR}" in remote
        i = remote.index("torch.distributed.run")
        assert remote[i - 1] == "-m"
        tail = remote[i + 1 :]
        assert "--nnodes=2" in tail and f"--nproc-per-node={nproc}" in tail
        assert "--rdzv-backend=c10d" in tail and "--rdzv-endpoint=h1:7777" in tail
        assert f"--local-addr={host}" in tail and "--max-restarts=0" in tail
        assert tail[-5:] == ["--no-python", "python", "train.py", "--lr", "0.1"]
    ids = {
        a for ln in (lines[1], lines[3]) for a in shlex.split(shlex.split(ln)[4]) if "rdzv-id" in a
    }
    assert len(ids) == 1  # one job id on both hosts


def test_dry_run_remote_shell_and_master_addr(capsys):
    argv = ["-H", "nsa=10.9.0.1:1,nsb=10.9.0.2:1", "--gloo", "--dry-run"]
    argv += ["--remote-shell", "ip netns exec {host} sh -c"]
    assert main([*argv, "--", "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    a = shlex.split(lines[1])
    assert a[:5] == ["ip", "netns", "exec", "nsa", "sh"] and a[5] == "-c"
    assert "--rdzv-endpoint=10.9.0.1:6666" in shlex.split(a[6])
    assert "--local-addr=10.9.0.2" in shlex.split(shlex.split(lines[3])[6])
