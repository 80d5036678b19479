"""Start-up activation: nothing without variables, each patch reversible, the fused swap."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import HERE, SITE, clean_env, run


def _probe(**extra: str) -> dict:
    env = clean_env(PYTHONPATH=str(SITE), **extra)
    out = run([sys.executable, str(HERE / "_probe.py")], env, limit=120)
    assert out.returncode == 0, out.stdout
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nothing_is_patched_without_variables():
    got = _probe()
    assert got["before_torch"] == [] and got["aiak_modules"] == []
    assert not got["lamb"] and not got["amp"]
    assert got["ddp_init"] == ["parallel", "distributed.py"]
    assert got["adamw"] == "torch.optim.adamw.type"
    assert got["init_pg"] != "aiak.launch._boot"


def test_auto_waits_for_torch_then_activates_what_is_asked():
    got = _probe(AIAK_AUTO="1")
    # before the script imports torch: only the start-up hook itself, no torch, no subpackage
    assert got["before_torch"] == ["aiak.launch", "aiak.launch._boot"]
    assert got["lamb"] and got["amp"]
    assert got["ddp_init"] == ["parallel", "distributed.py"]  # no comm variable: untouched
    assert got["adamw"] == "torch.optim.adamw.type"
    got = _probe(
        AIAK_AUTO="1", AIAK_FP16_COMPRESSION="1", AIAK_FUSED_OPTIMIZER="1", AIAK_BACKEND="gloo"
    )
    assert got["ddp_init"] == ["comm", "auto.py"]
    assert got["adamw"] == "torch.optim.adamw._Swap"
    assert got["init_pg"] == "aiak.launch._boot"


def test_variables_without_auto_change_nothing():
    got = _probe(AIAK_FP16_COMPRESSION="1", AIAK_FUSED_OPTIMIZER="1")
    assert got["aiak_modules"] == [] and got["ddp_init"] == ["parallel", "distributed.py"]


def test_malformed_variable_fails_at_import():
    env = clean_env(PYTHONPATH=str(SITE), AIAK_AUTO="1", AIAK_FP16_COMPRESSION="yes")
    out = run([sys.executable, "-c", "import torch"], env, limit=120)
    assert out.returncode != 0 and "AIAK_FP16_COMPRESSION must be 0 or 1" in out.stdout


def test_activate_and_deactivate_restore_everything():
    from aiak.launch import _boot

    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__
    classes = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
    init_pg = dist.init_process_group
    destroy_pg = dist.destroy_process_group
    amp_update = torch.amp.GradScaler.update
    env = {
        "AIAK_AUTO": "1",
        "AIAK_FP16_COMPRESSION": "1",
        "AIAK_FUSED_OPTIMIZER": "1",
        "AIAK_BACKEND": "gloo",
    }
    try:
        lines = _boot.activate(env)
        assert any(line.startswith("comm:") for line in lines)
        assert torch.nn.parallel.DistributedDataParallel.__init__ is not ddp_init
        assert torch.optim.AdamW is not classes[1] and hasattr(torch.optim, "LAMB")
        assert dist.init_process_group is not init_pg
        assert dist.destroy_process_group is not destroy_pg  # goes through comm.shutdown
        assert hasattr(torch.cuda.amp, "aiak_amp_decorate")
    finally:
        _boot.deactivate()
    assert torch.nn.parallel.DistributedDataParallel.__init__ is ddp_init
    assert (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) == classes
    assert dist.init_process_group is init_pg and torch.amp.GradScaler.update is amp_update
    assert dist.destroy_process_group is destroy_pg
    assert not hasattr(torch.optim, "LAMB") and not hasattr(torch.cuda.amp, "aiak_amp_decorate")
    # nothing asked: no hook, but the whole world's destroy still goes through comm.shutdown
    # (torch's own gloo teardown aborts an unchanged DDP script at exit now and then)
    try:
        assert _boot.activate({"AIAK_AUTO": "1"})
        assert torch.nn.parallel.DistributedDataParallel.__init__ is ddp_init
        assert dist.destroy_process_group is not destroy_pg
    finally:
        _boot.deactivate()
    assert dist.destroy_process_group is destroy_pg


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_fused_swap_keeps_groups_and_takes_torch_state(name):
    from aiak.optim import auto

    torch.manual_seed(0)
    ref_p = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    p = [torch.nn.Parameter(t.detach().clone()) for t in ref_p]
    kw = {"lr": 0.01, "weight_decay": 0.01} | ({"momentum": 0.9} if name == "SGD" else {})
    ref = getattr(torch.optim, name)(ref_p, **kw)

    def step(opt, params, seed):
        g = torch.Generator().manual_seed(seed)
        for q in params:
            q.grad = torch.randn(q.shape, generator=g)
        opt.step()

    for s in range(3):  # a torch run with state...
        step(ref, ref_p, s)
    from aiak.launch import _boot

    builders = auto.optimizer_builders({"AIAK_FUSED_OPTIMIZER": "1"})
    assert auto.optimizer_builders({}) == {}
    try:  # the start-up hook's one swap, with optim's builders
        _boot._swap_optimizers({n: ("optim", *b) for n, b in builders.items()})
        opt = getattr(torch.optim, name)(p, **kw)
        assert isinstance(opt, getattr(torch.optim, name))
    finally:
        _boot._restore_optimizers()
    assert getattr(torch.optim, name).__module__.startswith("torch.optim.")
    assert type(getattr(torch.optim, name)) is type
    assert type(opt).__name__ == f"Fused{'SGD' if name == 'SGD' else name}"
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.01
    with torch.no_grad():
        for q, r in zip(p, ref_p):
            q.copy_(r)
    # ...goes on in the swapped optimizer (a copy: torch loads same-device tensors as views)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for s in range(3, 6):
        step(ref, ref_p, s)
        step(opt, p, s)
    for q, r in zip(p, ref_p):
        torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-6)
    assert isinstance(opt, torch.optim.Optimizer)


def test_explicit_register_after_auto_registration():
    import datetime

    from torch import nn

    from aiak import comm
    from aiak.comm import auto

    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        auto.activate({"AIAK_FP16_COMPRESSION": "1"})
        try:
            model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        finally:
            auto.deactivate()
        assert model._aiak_hook is not None
        assert comm.register(model) is model._aiak_hook  # the env's hook: nothing new
        with pytest.raises(ValueError, match="already registered"):
            comm.register(model, comm.allreduce())
        model(torch.randn(3, 4)).sum().backward()  # the registered hook runs
        del model
    finally:
        dist.destroy_process_group()


def test_dgc_builds_ddp_with_its_bucket_size_unless_fusion_is_set():
    import datetime

    from torch import nn

    from aiak import comm
    from aiak.comm import DGC_BUCKET_MB, auto

    dgc_env = {"AIAK_DGC": "1", "AIAK_DGC_COMPRESS_RATIO": "0.01"}
    assert comm.bucket_cap_mb({}) is None  # DDP's own default
    assert comm.bucket_cap_mb(dgc_env) == DGC_BUCKET_MB == 50
    assert comm.bucket_cap_mb({**dgc_env, "PERSEUS_ALLREDUCE_FUSION": "16"}) == 16
    assert comm.bucket_cap_mb({**dgc_env, "PERSEUS_ALLREDUCE_FUSION": "auto"}) == 50
    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        caps = {}
        for label, env in (
            ("dgc", dgc_env),
            ("dgc16", {**dgc_env, "PERSEUS_ALLREDUCE_FUSION": "16"}),
        ):
            auto.activate(env)
            try:  # the plain spelling a script uses: the activation picks the bucket size
                caps[label] = nn.parallel.DistributedDataParallel(nn.Linear(4, 2)).bucket_bytes_cap
            finally:
                auto.deactivate()
        assert caps == {"dgc": 50 * 2**20, "dgc16": 16 * 2**20}
        # the API: aiak.comm.ddp with a DGC hook and no variables; another hook keeps DDP's
        built = comm.ddp(nn.Linear(4, 2), comm.dgc(compress_ratio=0.01), environ={})
        plain = comm.ddp(nn.Linear(4, 2), comm.allreduce(), environ={})
        assert built.bucket_bytes_cap == 50 * 2**20
        assert (
            plain.bucket_bytes_cap
            == nn.parallel.DistributedDataParallel(nn.Linear(4, 2)).bucket_bytes_cap
        )
        del built, plain
    finally:
        comm.shutdown()  # the hooks' helpers, then the group (when comm has not already)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dgc_activation_swaps_sgd_links_momentum_and_restores():
    from torch.utils.data.distributed import DistributedSampler

    from aiak import comm
    from aiak.comm import _dgc_auto
    from aiak.comm import auto as comm_auto
    from aiak.launch import _boot

    torch_sgd, set_epoch = torch.optim.SGD, DistributedSampler.set_epoch
    env = {"AIAK_DGC": "1", "AIAK_DGC_COMPRESS_RATIO": "0.01"}
    with pytest.raises(ValueError, match="contradicts AIAK_FUSED_OPTIMIZER"):
        comm_auto.activate({**env, "AIAK_FUSED_OPTIMIZER": "1"})
    with pytest.raises(
        ValueError, match=r"AIAK_DGC and AIAK_FUSED_OPTIMIZER both build torch\.optim\.SGD"
    ):
        _boot.activate({**env, "AIAK_FUSED_OPTIMIZER": "1"})  # one swap per torch class
    _boot.deactivate()
    assert torch.optim.SGD is torch_sgd and not comm_auto.active()
    assert _boot.activate(env)  # the one patch module: comm's activation and the SGD swap
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.6, weight_decay=1e-4)
        assert type(opt) is comm.DGCSGD and isinstance(opt, torch.optim.SGD)
        assert opt.param_groups[0]["momentum"] == 0.6  # now on weight decay only
        hook = comm.from_env(env)  # what DDP's patched __init__ registers
        _dgc_auto.on_ddp(model, hook)  # optimizer first, then the model: linked now
        assert (hook.state.momentum, hook.state.awaits_optimizer) == (0.6, False)
        other = torch.nn.Linear(2, 2)
        late = comm.from_env(env)
        _dgc_auto.on_ddp(other, late)  # the model first: it waits for its optimizer
        assert late.state.awaits_optimizer
        torch.optim.SGD(other.parameters(), lr=0.1)
        assert (late.state.momentum, late.state.awaits_optimizer) == (0.0, False)
        sampler = DistributedSampler(range(8), num_replicas=1, rank=0)
        sampler.set_epoch(3)
        assert sampler.epoch == 3 and hook.state.epoch == 3 and late.state.epoch == 3
    finally:
        _boot.deactivate()
    assert torch.optim.SGD is torch_sgd and DistributedSampler.set_epoch is set_epoch


def test_init_wrapper_fills_backend_and_timeout_for_every_spelling(monkeypatch):
    import datetime
    import inspect

    import torch.distributed.distributed_c10d as c10d

    from aiak.launch import _boot

    calls = []
    signature = inspect.signature(dist.init_process_group)

    def fake(*args, **kwargs):  # torch's signature, records what torch would get
        calls.append(dict(signature.bind(*args, **kwargs).arguments))

    fake.__signature__ = signature
    monkeypatch.setattr(dist, "init_process_group", fake)
    monkeypatch.setattr(c10d, "init_process_group", fake)
    seven, three = datetime.timedelta(seconds=7), datetime.timedelta(seconds=3)
    env = {"AIAK_BACKEND": "gloo", "GLOO_TIMEOUT_SECONDS": "7"}
    try:
        assert _boot._wrap_init(env) == (
            "launch: init_process_group() defaults to gloo and times out after 7 s"
        )
        init = dist.init_process_group
        assert c10d.init_process_group is init and init is not fake
        init()
        init("gloo")
        init(backend="gloo")
        init("gloo", "env://")
        init(init_method="env://", world_size=2, rank=0)
        init(device_id=torch.device("cpu"))
        init(backend="nccl", timeout=three)
        init(backend="nccl")
        init(None, "tcp://h:1", None, 2, 0)
        with pytest.raises(TypeError):
            init(backend="gloo", no_such_argument=1)  # torch's own error, not the wrapper's
    finally:
        _boot.deactivate()
    assert dist.init_process_group is fake
    want = [
        {"backend": "gloo", "timeout": seven},
        {"backend": "gloo", "timeout": seven},
        {"backend": "gloo", "timeout": seven},
        {"backend": "gloo", "init_method": "env://", "timeout": seven},
        {"backend": "gloo", "init_method": "env://", "world_size": 2, "rank": 0, "timeout": seven},
        {"backend": "gloo", "device_id": torch.device("cpu"), "timeout": seven},
        {"backend": "nccl", "timeout": three},
        {"backend": "nccl"},  # no NCCL timeout set: torch's own default
        {"backend": "gloo", "init_method": "tcp://h:1", "world_size": 2, "rank": 0,
         "timeout": seven},
    ]  # fmt: skip
    assert calls == want


def test_init_timeout_reads_the_backends_variable():
    import datetime

    from aiak.comm.env import init_timeout

    s = datetime.timedelta(seconds=1)
    env = {"GLOO_TIMEOUT_SECONDS": "9", "AIAK_NCCL_TIMEOUT_SECONDS": "4"}
    assert init_timeout("gloo", env) == 9 * s
    assert init_timeout("nccl", env) == 4 * s
    assert init_timeout(None, env) == 4 * s  # torch's default names both: the shorter
    assert init_timeout("cpu:gloo,cuda:nccl", {"GLOO_TIMEOUT_SECONDS": "9"}) == 9 * s
    assert init_timeout("gloo", {}) is None and init_timeout("nccl", env | {"X": "1"}) == 4 * s
    for bad in ("abc", "0", "nan", "-1", "inf"):
        with pytest.raises(ValueError, match="AIAK_NCCL_TIMEOUT_SECONDS must be a number"):
            init_timeout("nccl", {"AIAK_NCCL_TIMEOUT_SECONDS": bad})


def test_malformed_backend_or_timeout_fails_at_activation():
    from aiak.launch import _boot

    with pytest.raises(ValueError, match="AIAK_BACKEND must be gloo or nccl"):
        _boot._wrap_init({"AIAK_BACKEND": "mpi"})
    with pytest.raises(ValueError, match="GLOO_TIMEOUT_SECONDS must be a number"):
        _boot._wrap_init({"GLOO_TIMEOUT_SECONDS": "abc"})
    assert "init" not in _boot._saved


def test_uncaught_exception_goes_to_the_elastic_error_file(tmp_path):
    error_file = tmp_path / "error.json"
    env = clean_env(PYTHONPATH=str(SITE), AIAK_AUTO="1", TORCHELASTIC_ERROR_FILE=str(error_file))
    code = "import torch\ndef f():\n    raise ValueError('from the script')\nf()\n"
    out = run([sys.executable, "-c", code], env, limit=120)
    assert out.returncode == 1 and "ValueError: from the script" in out.stdout
    data = json.loads(error_file.read_text())["message"]
    assert data["message"] == "ValueError: from the script"
    assert "in f\n" in data["extraInfo"]["py_callstack"]
    assert data["extraInfo"]["py_callstack"].endswith("ValueError: from the script\n")


def test_child_processes_of_a_rank_activate_quietly():
    env = clean_env(PYTHONPATH=str(SITE), AIAK_AUTO="1", RANK="0")
    code = (
        "import subprocess, sys\nimport torch\n"
        "subprocess.run([sys.executable, '-c', 'import torch'], check=True, timeout=120)\n"
    )
    out = run([sys.executable, "-c", code], env, limit=240)
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("[aiak rank 0] optim: torch.optim.LAMB is aiak's LAMB") == 1


def test_overlap_variables_parse_and_conflict():
    from aiak.comm.env import parse_env

    cfg = parse_env(
        {
            "AIAK_OVERLAP_BACKWARD_AND_STEP": "1",
            "AIAK_CLIP_GRAD_FUNC": "value",
            "AIAK_CLIP_GRAD_FUNC_PARAMS": "0.5",
        }
    )
    assert cfg.overlap and cfg.clip == ("value", (("clip_value", 0.5),)) and cfg.dgc is None
    assert parse_env({"AIAK_OVERLAP_BACKWARD_AND_STEP": "1"}).clip is None
    with pytest.raises(ValueError, match="is a DGC setting"):  # clipping without its feature
        parse_env({"AIAK_CLIP_GRAD_FUNC": "norm", "AIAK_CLIP_GRAD_FUNC_PARAMS": "1"})
    both = parse_env(
        {
            "AIAK_OVERLAP_BACKWARD_AND_STEP": "1",
            "AIAK_DGC": "1",
            "AIAK_CLIP_GRAD_FUNC": "norm",
            "AIAK_CLIP_GRAD_FUNC_PARAMS": "2",
        }
    )  # the overlap steps DGC's buckets; the clipping runs once, inside DGC's hook
    assert both.overlap and both.clip is None
    assert dict(both.dgc)["clip_grad_func"] == "norm"
    with pytest.raises(ValueError, match="AIAK_OVERLAP_BACKWARD_AND_STEP must be 0 or 1"):
        parse_env({"AIAK_OVERLAP_BACKWARD_AND_STEP": "yes"})
    with pytest.raises(ValueError, match="go together"):
        parse_env({"AIAK_OVERLAP_BACKWARD_AND_STEP": "1", "AIAK_CLIP_GRAD_FUNC": "norm"})


def _world_of_one():
    import datetime

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )


def test_overlap_activation_steps_in_backward_and_restores():
    from torch import nn

    from aiak.comm import auto

    optimizer_init = torch.optim.Optimizer.__init__
    _world_of_one()
    try:
        auto.activate({"AIAK_OVERLAP_BACKWARD_AND_STEP": "1"})
        try:
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
            ref = nn.Linear(4, 3)
            ref.load_state_dict(model.module.state_dict())
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            for _ in range(3):
                x = torch.randn(5, 4)
                opt.zero_grad()
                model(x).square().sum().backward()  # the overlap steps here
                opt.step()  # ...and this does nothing
                ref_opt.zero_grad()
                ref(x).square().sum().backward()
                ref_opt.step()
            for p, q in zip(model.module.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            with pytest.raises(ValueError, match=r"optimizer.step\(closure\) cannot run"):
                opt.step(lambda: 0.0)
            lonely = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
            with pytest.raises(ValueError, match="no optimizer holds exactly"):
                lonely(torch.randn(1, 2))
        finally:
            auto.deactivate()
        assert torch.optim.Optimizer.__init__ is optimizer_init
        del model, lonely
    finally:
        dist.destroy_process_group()


def test_notices_for_settings_that_change_nothing():
    from aiak.comm.auto import notices

    assert notices({}, 1) == []
    env = {
        "PERSEUS_ACCUMULATE_N_STEPS": "4",
        "AIAK_POWERSGD_COMPRESSION": "1",
        "AIAK_START_COMPRESS_ITER": "50",
        "AIAK_HIERARCHICAL_ALLREDUCE": "1",
    }
    said = notices(env, 1)
    assert len(said) == 3
    assert "aiak.comm.accumulate" in said[0] and "from step 50" in said[1]
    assert "on one node is a flat allreduce" in said[2]
    assert len(notices(env, 2)) == 2 and len(notices(env, None)) == 2


def test_rank_0_activation_says_the_notices_once_without_aiakrun():
    env = clean_env(PYTHONPATH=str(SITE), AIAK_AUTO="1", RANK="0", PERSEUS_ACCUMULATE_N_STEPS="4")
    out = run([sys.executable, "-c", "import torch"], env, limit=120)
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("PERSEUS_ACCUMULATE_N_STEPS=4 (--accumulate-n-steps)") == 1
    out = run([sys.executable, "-c", "import torch"], {**env, "RANK": "1"}, limit=120)
    assert "PERSEUS_ACCUMULATE_N_STEPS" not in out.stdout
