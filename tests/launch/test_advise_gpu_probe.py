"""aiak-advise's probe, its GPU side on the CPU: the GPU's clock with stand-in CUDA events,
the casts and fp32 elements O2 would change, window attention found and counted, and the
O2 / swin-convert trials applied at the first forward."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import aiak.amp
from aiak.launch import _advise_facts as facts
from aiak.launch import _advise_model as advise_model
from aiak.launch import _advise_probe as probe_mod
from aiak.launch import _advise_work as work

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "recipes"))
import small_models  # noqa: E402


class _Stopped(Exception):
    pass


def _install(tmp_path, monkeypatch, trial: str = "") -> probe_mod._Probe:
    monkeypatch.setenv("AIAK_ADVISE_WARMUP", "3")
    monkeypatch.setenv("AIAK_ADVISE_STEPS", "4")
    monkeypatch.setenv("AIAK_ADVISE_TRY", trial)
    monkeypatch.delenv("AIAK_ADVISE_SECONDS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("AIAK_ADVISE_OWNER", raising=False)
    p = probe_mod.install(str(tmp_path))

    def stop(code: int) -> None:
        raise _Stopped(code)

    p.exit = stop
    return p


@pytest.fixture
def installed(tmp_path, monkeypatch):
    made = []
    before = (DataLoader.__iter__, torch.autograd.backward, torch.optim.Optimizer.__init__)

    def make(trial: str = "") -> probe_mod._Probe:
        made.append(_install(tmp_path, monkeypatch, trial))
        return made[-1]

    yield make
    for p in made:
        probe_mod.uninstall(p)
    after = (DataLoader.__iter__, torch.autograd.backward, torch.optim.Optimizer.__init__)
    assert after == before and not aiak.amp.installed()


def _train(model: nn.Module, steps: int, autocast: bool = False, shape=(4,), out=1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = DataLoader(TensorDataset(torch.randn(12, *shape), torch.randn(12, out)), batch_size=4)
    done = 0
    while done < steps:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1


class _Event:
    """A CUDA event's stand-in: the host's clock at record(); ``done`` says whether the
    GPU has passed it."""

    done = True
    made = 0
    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        type(self).made += 1
        self.t: float | None = None

    def record(self) -> None:
        type(self).recorded += 1
        self.t = time.perf_counter()

    def query(self) -> bool:
        return type(self).done

    def elapsed_time(self, end: _Event) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


class _Stream:
    def query(self) -> bool:
        return False  # always work queued: a busy GPU


@pytest.fixture
def fake_cuda(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    monkeypatch.setattr(work, "copy_rate", lambda torch: 2.5e12)
    real = facts.optimizer_facts

    def on_cuda(opt):
        return {**real(opt), "device": "cuda"}

    monkeypatch.setattr(probe_mod, "optimizer_facts", on_cuda)
    return syncs


@pytest.mark.parametrize("passed", [True, False])
def test_gpu_clock_gives_each_measured_step_its_phases_from_events(
    installed, fake_cuda, tmp_path, passed
):
    _Event.done = passed
    _Event.made = _Event.recorded = 0
    probe = installed()
    torch.manual_seed(0)
    with pytest.raises(_Stopped):
        _train(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), 100)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["cuda"] and len(doc["records"]) == 4
    for rec in doc["records"]:
        gpu = rec["gpu"]
        # the stand-in events keep the host's clock: each GPU interval is inside its host phase
        for phase in ("data", "forward", "backward", "optimizer"):
            assert 0 < gpu[phase] <= rec[phase] + 1e-3
        # the phases lie inside the step's span, one after another
        phases = ("data", "forward", "backward", "optimizer")
        assert sum(gpu[p] for p in phases) <= gpu["step"] + 1e-9
        # the step spans from the previous step's end to this one's, as the host's step does
        # (a few Python lines apart; generous for a loaded machine)
        assert gpu["step"] == pytest.approx(rec["step"], abs=0.05)
    # one epoch start in three steps: its first batch is also the epoch-start interval
    assert any(r["gpu"]["data_epoch_start"] > 0 for r in doc["records"])
    # events only in the measured steps: start + end per phase (data, forward, backward,
    # optimizer) and one end per step, plus the step before the first measured one
    # (and two per StopIteration at an epoch's end, whose wait joins the next step's data)
    assert 4 * (4 * 2 + 1) + 1 <= _Event.recorded <= 4 * (4 * 2 + 1) + 1 + 2 * 2
    # events the probe has read are recorded again: fewer made than recorded
    assert (_Event.made < _Event.recorded) == passed
    # the events are read once the GPU has passed them; otherwise once, at the end
    assert fake_cuda == ([] if passed else [1])
    assert not probe.gpu_pending
    assert doc["opt_samples"] == 4 and doc["opt_empty"] == 0
    assert doc["rates"]["copy_Bps"] == 2.5e12


class _GpuClock:
    """How far the stand-in compute stream runs behind the host (seconds, simulated)."""

    lag = 0.0


class _LaggedEvent(_Event):
    """A stand-in event on a compute stream that runs ``_GpuClock.lag`` behind the host."""

    def record(self) -> None:
        super().record()
        self.t += _GpuClock.lag


# Simulated, not slept: each hook's own work on the compute stream (a compression's casts) and
# the compute stream's wait, once every gradient is computed, for the link
HOOK_WORK = 0.05
LINK_WAIT = 0.5


def _nccl_like(state, bucket):
    """NCCL as the compute stream sees it: the host only queues the collective (the future is
    complete at once), the stream runs the hook's own kernels, and after the last bucket the
    backward's end waits for the link (a final callback of the backward moves the clock)."""
    _GpuClock.lag += HOOK_WORK
    if bucket.is_last():

        def wait_for_link() -> None:
            _GpuClock.lag += LINK_WAIT

        torch.autograd.Variable._execution_engine.queue_callback(wait_for_link)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_gpu_clock_takes_exposed_comm_from_the_hooks_events_not_the_host(
    installed, fake_cuda, tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "Event", _LaggedEvent)
    _GpuClock.lag = 0.0
    probe = installed()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        # 1 MiB buckets: DDP's rebuild after the first step gives the 1 MiB weights three
        wide = [nn.Linear(4, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()]
        layers = [*wide, nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)]
        net = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=1)
        net.register_comm_hook(None, _nccl_like)
        with pytest.raises(_Stopped):
            _train(net, 100)
        del net
    finally:
        dist.destroy_process_group()
    doc = json.loads((tmp_path / "rank0.json").read_text())
    buckets = doc["facts"]["buckets"]
    assert buckets >= 2
    simulated = buckets * HOOK_WORK + LINK_WAIT
    assert len(doc["records"]) == 4 and not probe.gpu_pending
    for rec in doc["records"]:
        gpu = rec["gpu"]
        # the host sees the hooks' calls only: the wait happens on the (stand-in) GPU
        assert rec["comm"] < LINK_WAIT
        # on the GPU's clock: every hook's own work and the wait after the last one, plus the
        # host's time in those spans (inside its backward; a margin for a loaded machine)
        assert simulated <= gpu["comm"] <= simulated + rec["backward"] + 0.05
        assert gpu["comm"] <= gpu["backward"]
    b = advise_model.breakdown([doc])
    assert b.clock == "gpu"
    assert b.comm >= simulated and b.host_s["comm"] < LINK_WAIT


@pytest.mark.cuda
def test_on_a_gpu_the_compute_streams_wait_for_a_side_stream_collective_is_comm(
    installed, tmp_path
):
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    cycles = 20_000_000  # ~10-20 ms of torch.cuda._sleep, timed here: the link's stand-in
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    wait = start.elapsed_time(end) / 1e3

    def link_like(state, bucket):
        # NCCL as DDP sees it: the collective runs on its own stream once the gradients are
        # there, and the future's value is ready once that stream has passed it
        buf = bucket.buffer()
        side.wait_stream(torch.cuda.current_stream())
        fut = torch.futures.Future(devices=[dev])
        with torch.cuda.stream(side):
            if bucket.is_last():
                torch.cuda._sleep(cycles)
            fut.set_result(buf)
        return fut

    installed()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layers = [nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()]
        net = nn.parallel.DistributedDataParallel(
            nn.Sequential(*layers, nn.Linear(512, 1)).to(dev), device_ids=[dev], bucket_cap_mb=1
        )
        net.register_comm_hook(None, link_like)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x, y = torch.randn(32, 512, device=dev), torch.randn(32, 1, device=dev)
        with pytest.raises(_Stopped):
            for _ in range(100):
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss.item()  # the host waits for the GPU here, in the loop's code
        del net, opt
    finally:
        dist.destroy_process_group()
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["cuda"] and len(doc["records"]) == 4
    for rec in doc["records"]:
        # the host only queued the stand-in collective; the compute stream waited for it
        assert rec["comm"] < wait / 2
        assert 0.8 * wait <= rec["gpu"]["comm"] <= rec["gpu"]["backward"]
    b = advise_model.breakdown([doc])
    assert b.clock == "gpu" and b.comm >= 0.8 * wait


class _Net(nn.Module):
    """Linear, an op on CPU autocast's fp32 list (mse_loss; on CUDA layer_norm and softmax
    are), Linear: what autocast casts around such an op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(nn.functional.mse_loss(h, torch.ones_like(h), reduction="none"))


def test_counted_step_finds_autocast_casts_of_weights_and_fp32_ops(installed, tmp_path):
    installed()
    torch.manual_seed(0)
    with pytest.raises(_Stopped):
        _train(_Net(), 100, autocast=True)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    casts, weights, fp32 = doc["amp"]["forward"]
    # each Linear's fp32 weight and bias go to bf16 in the forward
    assert weights == (4 * 16 + 16) + (16 * 1 + 1)
    # plus the activations: the input to bf16, fc1's output and its bf16 target up to fp32
    # for the fp32-list op, whose fp32 output goes back to bf16 for fc2 (batch 4)
    assert casts == weights + 4 * 4 + 2 * (4 * 16) + 4 * 16
    assert fp32 >= 4 * 16  # the fp32-list op's output
    bcasts, bweights, bfp32 = doc["amp"]["backward"]
    assert bweights == 0 and bcasts >= weights  # the weights' grads come back to fp32
    assert bfp32 > 0
    assert doc["facts"]["autocast"] == "cpu:bfloat16"
    assert doc["facts"]["optimizer"]["momentum"] == 0.9
    assert doc["facts"]["optimizer"]["amp_scaling"] is False
    assert doc["facts"]["optimizer"]["grad_scaler"] is False


def test_precision_of_single_ops():
    w = torch.randn(8, 8)
    seen = []

    def on(func, args, out):
        seen.append(work.precision(func, args, out, {w.data_ptr()}))

    with work.counting(on):
        w.to(torch.float16)
        torch.randn(3, 5).to(torch.bfloat16)
        torch.ones(6, dtype=torch.float16).float()
        torch.ones(7).to(torch.int64)  # not a float cast
        torch.ones(2, 3).softmax(-1)
    assert (64, 64, 0) in seen
    assert (15, 0, 0) in seen
    assert (6, 0, 0) in seen
    assert (0, 0, 6) in seen  # softmax writes 6 fp32 elements
    assert not any(s[0] == 7 for s in seen)


def test_window_attention_is_found_and_its_scores_counted(installed, tmp_path):
    installed()
    torch.manual_seed(0)
    model = small_models.SwinLike(dim=16, heads=2, res=8, ws=4, depth=1, classes=3)
    with pytest.raises(_Stopped):
        _train(model, 100, shape=(3, 32, 32), out=3)
    wa = json.loads((tmp_path / "rank0.json").read_text())["facts"]["window_attention"]
    assert wa["modules"] == 2 and wa["fused"] == 0 and wa["dropout"] == 0 and wa["sdpa"] == 0
    # batch 4, 8x8 map in 4x4 windows: 16 windows of N = 16, 2 heads, two blocks
    assert wa["scores"] == 2 * (4 * 4) * 2 * 16**2


def test_o2_trial_decorates_the_model_and_optimizer_at_the_first_forward(installed, tmp_path):
    installed("o2")
    assert aiak.amp.installed()  # every GradScaler follows O2's policy in the trial
    torch.manual_seed(0)
    model = _Net()
    with pytest.raises(_Stopped):
        _train(model, 100, autocast=True)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["facts"]["trials"] == {"o2": "applied"}
    assert doc["facts"]["optimizer"]["aiak_o2"]
    assert model.fc1.weight.dtype == torch.bfloat16
    # pure half inside the model: no weight casts, no fp32-list op in fp32; O2's forward
    # casts the input in (batch 4 x 4) and the output back out (4 x 1)
    casts, weights, fp32 = doc["amp"]["forward"]
    assert weights == 0 and fp32 == 0 and casts == 4 * 4 + 4 * 1
    for rec in doc["records"]:
        assert rec["forward"] > 0 and rec["optimizer"] > 0


def test_swin_convert_trial_fuses_the_window_attention(installed, tmp_path):
    installed("swin-convert")
    torch.manual_seed(0)
    model = small_models.SwinLike(dim=16, heads=2, res=8, ws=4, depth=1, classes=3)
    with pytest.raises(_Stopped):
        _train(model, 100, shape=(3, 32, 32), out=3)
    facts = json.loads((tmp_path / "rank0.json").read_text())["facts"]
    assert facts["trials"] == {"swin-convert": "applied"}
    wa = {"modules": 0, "sdpa": 0, "fused": 2, "dropout": 0, "scores": 0}
    assert facts["window_attention"] == wa


def test_o2_trial_says_why_when_no_optimizer_holds_the_model(installed):
    probe = installed("o2")
    lonely = nn.Linear(2, 2)
    assert probe.decorate(lonely).startswith("not applied: no optimizer holds")
    assert lonely.weight.dtype == torch.float32


def test_o2_trial_on_a_model_already_decorated_says_so_and_does_not_raise(installed):
    probe = installed("o2")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    aiak.amp.decorate(model, opt, dtype=torch.bfloat16)
    assert probe.decorate(model).startswith("not applied: ")
    assert model.weight.dtype == torch.bfloat16
