"""aiak-advise's probe in this process: what it times and counts, how it stops, uninstall."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aiak.launch import _advise_probe as probe_mod
from aiak.launch import _advise_work as work


class _Stopped(Exception):
    pass


@pytest.fixture
def probe(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_ADVISE_WARMUP", "2")
    monkeypatch.setenv("AIAK_ADVISE_STEPS", "4")
    monkeypatch.delenv("AIAK_ADVISE_SECONDS", raising=False)
    monkeypatch.delenv("AIAK_ADVISE_TRY", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("AIAK_ADVISE_OWNER", raising=False)
    before = (DataLoader.__iter__, torch.autograd.backward)
    p = probe_mod.install(str(tmp_path))

    def stop(code: int) -> None:
        raise _Stopped(code)

    p.exit = stop
    yield p
    probe_mod.uninstall(p)
    assert (DataLoader.__iter__, torch.autograd.backward) == before


def _train(steps: int, ddp: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 1)), batch_size=4)
    done = 0
    while done < steps:
        for x, y in data:
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1


def test_probe_times_every_phase_counts_ops_and_stops_after_the_measured_steps(probe, tmp_path):
    with pytest.raises(_Stopped):
        _train(100)
    assert probe.step == 2 + 4  # warm-up, then the measured steps, then the rank ends
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["complete"] and len(doc["records"]) == 4
    for rec in doc["records"]:
        assert rec["step"] > 0 and rec["forward"] > 0 and rec["backward"] > 0
        assert rec["optimizer"] > 0 and rec["data"] > 0 and rec["comm"] == 0
        assert rec["forward"] + rec["backward"] + rec["optimizer"] + rec["data"] <= rec["step"]
    # the last warm-up step was counted: 3 batches per epoch, so it read one batch
    assert doc["ops"]["forward"] >= 3 and doc["ops"]["backward"] > doc["ops"]["forward"]
    assert doc["ops"]["optimizer"] >= 4  # four tensors, one update each at least
    assert doc["work"]["forward"][1] == 4 * 8 * 4 + 4 * 1 * 8  # two addmm: batch x out x in
    facts = doc["facts"]
    assert facts["optimizer"]["type"] == "SGD" and facts["optimizer"]["tensors"] == 4
    assert facts["optimizer"]["parameters"] == 4 * 8 + 8 + 8 + 1
    assert facts["forward_roots"] == ["Sequential"]
    assert facts["autocast"] is None and not facts["optimizer"]["aiak_o2"]
    assert facts["loaders"] == [
        {
            "num_workers": 0,
            "persistent_workers": False,
            "pin_memory": False,
            "batches": 3,
            "map_style": True,
            "cross_epoch_trial": False,
        }
    ]
    # epoch starts: one step in three waits at iter() + the first batch
    assert sum(r["data_epoch_start"] > 0 for r in doc["records"]) in (1, 2)
    assert doc["op_cost_s"] > 0 and doc["rates"]["elem_s"] > 0 and doc["rates"]["mac_s"] > 0


def test_probe_sees_ddp_buckets_through_its_timed_allreduce_hook(probe, tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(_Stopped):
            _train(100, ddp=True)
    finally:
        dist.destroy_process_group()
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["facts"]["buckets"] >= 1
    assert doc["facts"]["grad_bytes"] == (4 * 8 + 8 + 8 + 1) * 4
    assert doc["facts"]["ddp"][0]["bucket_cap_bytes"] > 0
    assert all(0 <= r["comm"] <= r["backward"] for r in doc["records"])
    assert doc["backend"] == "gloo"


def test_probe_records_the_autocast_of_the_forward(probe, tmp_path):
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(_Stopped):
        _train(100)
    facts = json.loads((tmp_path / "rank0.json").read_text())["facts"]
    assert facts["autocast"] == "cpu:bfloat16"


def test_a_script_that_ends_early_writes_what_it_has(probe, tmp_path):
    _train(3)
    probe.finish(complete=False)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert not doc["complete"] and doc["steps_seen"] == 3 and len(doc["records"]) == 1


@pytest.mark.parametrize(
    "env",
    [
        {"LOCAL_RANK": None},  # a launcher, not a worker
        {"LOCAL_RANK": "0", "AIAK_ADVISE_OWNER": "1"},  # a process a measured rank started
    ],
)
def test_boot_does_nothing_outside_a_measured_worker(monkeypatch, env):
    import sys

    monkeypatch.setenv("AIAK_ADVISE_DIR", "/nonexistent")
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    finders = list(sys.meta_path)
    probe_mod.boot()
    assert sys.meta_path == finders and not os.path.exists("/nonexistent")


def test_install_marks_this_process_as_the_owner(probe):
    assert os.environ["AIAK_ADVISE_OWNER"] == str(os.getpid())


@pytest.mark.parametrize(
    ("make", "macs"),
    [
        (lambda: torch.mm(torch.ones(3, 5), torch.ones(5, 7)), 3 * 7 * 5),
        (lambda: torch.addmm(torch.ones(7), torch.ones(3, 5), torch.ones(5, 7)), 3 * 7 * 5),
        (lambda: torch.bmm(torch.ones(2, 3, 5), torch.ones(2, 5, 7)), 2 * 3 * 7 * 5),
        (
            lambda: nn.functional.conv2d(torch.ones(1, 2, 6, 6), torch.ones(4, 2, 3, 3)),
            4 * 4 * 4 * (2 * 3 * 3),
        ),
        (lambda: torch.ones(10) + 1, 0),
    ],
)
def test_work_counts_multiply_adds_of_matmuls_and_convolutions(make, macs):
    seen = []
    with work.counting(lambda func, args, out: seen.append(work.work(func, args, out))):
        out = make()
    assert seen[-1] == (out.numel(), macs)


def test_seconds_bound_rank_0_names_the_last_step_two_ahead(probe, tmp_path):
    probe.steps, probe.seconds = 10**9, 1e-9
    with pytest.raises(_Stopped):
        _train(100)
    # the first measured step passes the time: the last step is named two steps ahead
    assert (tmp_path / "stop").read_text() == str(2 + 1 + 2)
    assert probe.step == 2 + 1 + 2
    assert len(json.loads((tmp_path / "rank0.json").read_text())["records"]) == 3


def test_stream_samples_count_an_empty_gpu_queue_at_each_boundary(probe, tmp_path, monkeypatch):
    class _Stream:
        def __init__(self) -> None:
            self.calls = 0

        def query(self) -> bool:  # empty at every other boundary
            self.calls += 1
            return self.calls % 2 == 0

    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    probe.cuda = True
    probe.samples = [0, 0]
    for _ in range(6):
        probe.sample_stream()
    assert probe.samples == [6, 3] and stream.calls == 6
    probe.cuda = False  # a CPU model: no sampling
    probe.sample_stream()
    assert stream.calls == 6
