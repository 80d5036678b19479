"""examples/recipes/ and benchmarks/bench_e2e.py on CPU: the recipes run as plain scripts
(and under ``aiakrun`` with DDP), and ``bench_e2e.py --quick`` runs every recipe's tiny model
in the four modes and writes its CSV. Timings are not asserted (numbers come from the GPU
run); the losses are: every mode trains the same steps on the same data."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("swin_t", "resnet50", "bert_lamb", "yolox_simota")
MODES = ("o1", "o1_compile", "aiak", "aiak_compile")
# one intra-op thread: the CPU is shared, and more threads only contend
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "aiak"), [("swin_t", True), ("yolox_simota", False)])
def test_recipe_runs_as_a_script(recipe: str, aiak: bool) -> None:
    script = ROOT / "examples" / "recipes" / f"{recipe}.py"
    flag = "--aiak" if aiak else "--no-aiak"
    out = _run([sys.executable, str(script), "--tiny", "--steps", "3", flag], timeout=300)
    mode, rest = out.strip().splitlines()[-1].split(": loss ")
    assert mode == ("aiak" if aiak else "O1")
    first, last = (float(v) for v in rest.split(" over")[0].split(" -> "))
    assert math.isfinite(first) and last < first  # three steps on one batch: it learns


def _build(recipe: str, monkeypatch: pytest.MonkeyPatch, **kwargs):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "recipes"))
    return importlib.import_module(recipe).build(tiny=True, batch=4, **kwargs)


def test_graph_needs_cuda_and_the_bare_model(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _build("bert_lamb", monkeypatch, aiak=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        run.graph()
    run.device = torch.device("cuda")  # the checks before any CUDA work
    run.forward = lambda x: x
    with pytest.raises(ValueError, match=r"before torch\.compile or DDP"):
        run.graph()
    with pytest.raises(ValueError, match=r"Run\.ddp: wrap the model before torch\.compile"):
        run.ddp()  # the forward is no longer the bare model (compiled, or already wrapped)


def test_recipe_flags_are_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "recipes"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    recipe, bench_e2e = importlib.import_module("_recipe"), importlib.import_module("bench_e2e")
    for flags, message in (  # in-process: each subprocess would cost seconds of CI
        (["--steps", "0"], "--steps must be >= 1"),
        (["--compile-mode", "reduce-overhead"], "--compile-mode needs --compile"),
        (["--cuda-graphs", "--compile"], "--cuda-graphs and --compile exclude each other"),
        (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
    ):
        monkeypatch.setattr(sys, "argv", ["swin_t.py", "--tiny", *flags])
        with pytest.raises(SystemExit) as exit_:
            recipe.parse("a recipe", batch=64, tiny_batch=4)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, flags
    for flags, message in (
        (["--graphs"], "--graphs needs a CUDA device"),
        (["--modes", "o1,aiak_graphs"], "the graphed modes need a CUDA device"),
        (["--modes", "o1,o2"], "must be distinct modes of"),
        (["--modes", "aiak,aiak"], "must be distinct modes of"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench_e2e.main(["--quick", *flags, "--device", "cpu", "--out", str(tmp_path)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, flags


@pytest.mark.cuda
@pytest.mark.parametrize("aiak", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_graphed_run_trains_like_the_eager_one_on_cuda(
    recipe: str, aiak: bool, cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Run.graph`` (the model's forward and backward replayed from CUDA graphs): O1's
    autocast casts, O2's model, aiak's window attention and the fused optimizers inside or
    after the graphs train the same steps as the eager run."""
    eager = _build(recipe, monkeypatch, aiak=aiak, device=cuda_device)
    graphed = _build(recipe, monkeypatch, aiak=aiak, device=cuda_device).graph()
    assert graphed.graphed
    eager.next_batch()  # graph() took one batch to learn the inputs: same data from here on
    for _ in range(4):
        loss, loss_g = eager.step(), graphed.step()
        torch.testing.assert_close(loss_g, loss, rtol=1e-2, atol=1e-3)
    # Adam and LAMB move an element by about lr whatever its gradient's size: where a tiny
    # gradient differs in sign between the runs (a captured step may round otherwise), the
    # element differs by up to 2 x lr a step (swin_t's AdamW: lr 1e-3, 4 steps; measured 1.6e-3).
    # (SGD's step is proportional to the gradient: no such margin.)
    adaptive = any(k in type(eager.optimizer).__name__ for k in ("Adam", "LAMB"))
    lr = max(g["lr"] for g in eager.optimizer.param_groups)
    atol = 8 * lr if adaptive else 1e-3
    for p, p_g in zip(eager.model.parameters(), graphed.model.parameters(), strict=True):
        torch.testing.assert_close(p_g.float(), p.float(), rtol=1e-2, atol=atol)


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("recipe", "aiak", "hook"),
    [("resnet50", True, "none"), ("resnet50", False, "fp16"), ("swin_t", True, "fp16")],
)
def test_graphed_model_under_ddp_trains_like_eager_ddp(recipe: str, aiak: bool, hook: str) -> None:
    """Graphed, then wrapped in DDP (the recipes' order under a launcher), on 2 GPUs: DDP's
    allreduce (and aiak's fp16 hook) get the graphed backward's gradients; the worker checks
    the losses and weights against eager DDP and the replicas against each other."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, has {torch.cuda.device_count()}")
    env = dict(ENV, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    worker = ROOT / "tests" / "compile" / "_ddp_graphs_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker)]
    done = subprocess.run(
        [*cmd, recipe, str(int(aiak)), hook],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(": OK") == 2, done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_recipe_under_aiakrun_with_ddp() -> None:
    aiakrun = shutil.which("aiakrun", path=str(Path(sys.executable).parent))
    assert aiakrun, "aiakrun is installed with aiak"
    script = ROOT / "examples" / "recipes" / "bert_lamb.py"
    cmd = [aiakrun, "-np", "2", "--gloo", "--", sys.executable, str(script), "--tiny"]
    out = _run([*cmd, "--steps", "3", "--device", "cpu"], timeout=400)
    assert out.count("aiak: loss") == 1, out  # rank 0 reports


@pytest.mark.slow
def test_bench_e2e_quick_writes_every_mode(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench_e2e.py", "--quick", "--warmup", "1", "--rounds", "2"]
    cmd += ["--steps", "1", "--backend", "aot_eager", "--out", str(tmp_path)]
    _run(cmd, timeout=1200, cwd=ROOT / "benchmarks")
    with (tmp_path / "e2e.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    got = {(r["recipe"], r["mode"]): r for r in rows}
    assert set(got) == {(n, m) for n in RECIPES for m in MODES}
    for (name, mode), r in got.items():
        assert r["status"] == "ok"
        assert float(r["ms_step"]) > 0 and len(r["ms_rounds"].split()) == 2
        assert float(r["state_mib"]) > 0
        # same data, same steps: compiled modes follow their eager twin closely, aiak's O2
        # follows O1 (bert_lamb: LAMB against AdamW, a different optimizer)
        loss, o1 = float(r["loss"]), float(got[(name, "o1")]["loss"])
        eager = float(got[(name, mode.removesuffix("_compile"))]["loss"])
        assert math.isfinite(loss)
        assert abs(loss - eager) <= 0.02 * abs(eager), (name, mode, loss, eager)
        assert abs(loss - o1) <= (0.1 if name == "bert_lamb" else 0.02) * abs(o1), (name, mode)
        # the aiak set-up keeps fp32 masters next to the half model: more state than O1
        if mode.startswith("aiak"):
            assert float(r["state_mib"]) > float(got[(name, "o1")]["state_mib"])


@pytest.mark.slow
def test_bench_e2e_ddp_wraps_every_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--ddp`` in-process as rank 0 of a one-rank launch (gloo): every mode's model is in
    DDP (compiled modes compile the DDP model), the rows say so, the group is gone after."""
    import socket

    import torch.distributed as dist

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "recipes"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench_e2e = importlib.import_module("bench_e2e")
    base = ["--quick", "--recipes", "resnet50", "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:  # no launcher's environment
        bench_e2e.main([*base, "--ddp"])
    assert exit_.value.code == 2 and "--ddp runs under a launcher" in capsys.readouterr().err
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in {**env, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:  # two ranks, each would time its own copy
        bench_e2e.main(base)
    assert exit_.value.code == 2 and "pass --ddp" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    wrapped = []

    class DDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module, **kwargs):
            super().__init__(module, **kwargs)
            wrapped.append(module)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", DDP)
    fast = ["--warmup", "1", "--rounds", "1", "--steps", "1", "--backend", "aot_eager"]
    rows = bench_e2e.main([*base, "--ddp", *fast])
    assert not dist.is_initialized()
    assert [r["mode"] for r in rows] == list(MODES) and len(wrapped) == len(MODES)
    for r in rows:
        assert r["status"] == "ok" and r["ddp"] is True and r["world_size"] == 1, r
        assert math.isfinite(r["loss"]) and r["ms_step"] > 0
    with (tmp_path / "e2e.csv").open(newline="") as f:
        assert {row["ddp"] for row in csv.DictReader(f)} == {"True"}


def test_bench_e2e_skips_a_recipe_whose_package_is_missing(tmp_path: Path) -> None:
    missing = [n for n, pkg in (("swin_t", "timm"), ("resnet50", "torchvision"))
               if importlib.util.find_spec(pkg) is None]  # fmt: skip
    if not missing:
        pytest.skip("timm and torchvision are both installed: nothing is skipped")
    cmd = [sys.executable, "bench_e2e.py", "--recipes", ",".join(missing), "--out", str(tmp_path)]
    _run(cmd, timeout=300, cwd=ROOT / "benchmarks")
    with (tmp_path / "e2e.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["recipe"] for r in rows] == missing
    assert all(r["status"].startswith("skipped:") and "not installed" in r["status"] for r in rows)
