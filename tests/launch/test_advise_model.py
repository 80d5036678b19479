"""aiak-advise's attribution and cost model on hand-written rank reports (no process): CPU jobs
and the rules every device shares; test_advise_model_gpu.py has the GPU's."""

from __future__ import annotations

import json

import pytest
from _advise_reports import MS, record, report
from hypothesis import given
from hypothesis import strategies as st

from aiak.launch import _advise_breakdown as attribution
from aiak.launch import _advise_model as model
from aiak.launch import _advise_report as report_text


def test_phases_add_up_to_the_trimmed_step():
    recs = [record(forward=2, backward=3, optimizer=1) for _ in range(8)]
    recs += [record(forward=200, backward=3, optimizer=1), record(forward=0.5, backward=0.5)]
    b = model.breakdown([report(recs)])
    # the slowest and fastest fifth (one step each of ten) are dropped
    assert b.step == pytest.approx(6 * MS)
    assert b.forward + b.backward + b.optimizer + b.data + b.other == pytest.approx(b.step)
    assert b.steps == 10


def test_no_measured_step_is_a_clear_error():
    with pytest.raises(ValueError, match=r"finished 3 optimizer step\(s\), the warm-up is 5"):
        model.breakdown([{**report([]), "steps_seen": 3}])
    with pytest.raises(ValueError, match="no rank wrote a report"):
        model.breakdown([])


def test_ranks_are_averaged():
    a = report([record(forward=2, backward=2)] * 5, rank=0, world=2)
    b = report([record(forward=4, backward=4)] * 5, rank=1, world=2)
    assert model.breakdown([a, b]).step == pytest.approx(6 * MS)


def test_link_bound_two_ranks_advises_fp16_first_and_powersgd_after():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    facts = {"buckets": 2, "grad_bytes": 4 * 2**20, "ddp": [{"bucket_cap_bytes": 25 * 2**20}]}
    b = model.breakdown([report(recs, world=2, local=2, **facts)])
    assert b.bottleneck() == "link"
    advice = model.advise(b)
    assert [a.feature for a in advice][:2] == ["fp16 gradient compression", "PowerSGD (rank 2)"]
    assert advice[0].gain_s == pytest.approx(40 * MS)
    assert advice[0].flags == ("--fp16-compression",)
    # PowerSGD sends far fewer bytes but changes the update: it ranks after fp16
    assert advice[1].gain_s > advice[0].gain_s and advice[1].changes_update
    # one node: no two-level allreduce; AdamW: no DGC
    assert not any(a.feature in ("hierarchical allreduce", "DGC") for a in advice)


def test_compression_already_on_is_not_advised_again():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    b = model.breakdown([report(recs, world=2, local=2, grad_bytes=4 * 2**20)])
    on = {"AIAK_FP16_COMPRESSION": "1"}
    assert not [a for a in model.advise(b, on) if a.phase == "comm"]


def test_two_nodes_get_the_hierarchical_allreduce_with_its_bytes_ratio():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    b = model.breakdown([report(recs, world=8, local=4, grad_bytes=2**20)])
    hier = next(a for a in model.advise(b) if a.feature == "hierarchical allreduce")
    # through a node's link: the flat ring 2 x 7/8 of the gradients, two levels 2 x 1/2
    assert hier.gain_s == pytest.approx(80 * MS * (1 - (1 / 2) / (7 / 8)))
    assert hier.flags == ("--hierarchical-allreduce",) and not hier.changes_update


def test_dgc_only_for_sgd():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    opt = {**report([])["facts"]["optimizer"], "type": "SGD", "module": "torch.optim.sgd"}
    b = model.breakdown([report(recs, world=2, local=2, optimizer=opt)])
    dgc = next(a for a in model.advise(b) if a.feature == "DGC")
    assert dgc.gain_s == pytest.approx(80 * MS * (1 - 2 * 0.001 * 12 / 8))


def test_optimizer_bound_advises_the_fused_optimizer_from_its_op_cost():
    recs = [record(forward=1, backward=2, optimizer=40)] * 10
    opt = {**report([])["facts"]["optimizer"], "tensors": 400, "type": "Adam"}
    ops = {"forward": 3, "backward": 800, "optimizer": 4000}
    b = model.breakdown([report(recs, ops=ops, optimizer=opt)])
    assert b.bottleneck() == "optimizer"
    first = model.advise(b)[0]
    assert first.feature == "fused optimizer" and first.flags == ("--fuse-optimizer",)
    # 4000 ops x 5 us = 20 ms of host cost; one group of 400 tensors keeps 1/400 of it
    assert first.gain_s == pytest.approx(20 * MS * (1 - 1 / 400))
    assert not model.advise(b, {"AIAK_FUSED_OPTIMIZER": "1"})


@pytest.mark.parametrize(
    "opt",
    [
        {"fused": True},  # torch's fused kernel already
        {"module": "mylib.optim", "type": "Adam"},  # not torch's class
        {"type": "RMSprop", "module": "torch.optim.rmsprop"},  # no fused twin
    ],
)
def test_no_fused_optimizer_without_a_twin_to_swap_in(opt):
    recs = [record(forward=1, backward=2, optimizer=40)] * 10
    o = {**report([])["facts"]["optimizer"], "tensors": 400, **opt}
    b = model.breakdown([report(recs, ops={"optimizer": 4000}, optimizer=o)])
    assert not [a for a in model.advise(b) if a.phase == "optimizer"]


def test_foreach_optimizer_gain_comes_from_its_few_ops():
    recs = [record(forward=1, backward=2, optimizer=40)] * 10
    o = {**report([])["facts"]["optimizer"], "tensors": 400, "foreach": True}
    b = model.breakdown([report(recs, ops={"optimizer": 12}, optimizer=o)])
    # 12 multi-tensor ops x 5 us: 60 us of 43 ms, under the 2% worth advising
    assert not [a for a in model.advise(b) if a.phase == "optimizer"]


def test_data_bound_at_epoch_starts_advises_cross_epoch_loader():
    recs = [record(data=90, data_epoch_start=85, forward=1, backward=1)] * 10
    loader = {"num_workers": 2, "persistent_workers": False, "map_style": True, "batches": 2}
    b = model.breakdown([report(recs, loaders=[loader])])
    assert b.bottleneck() == "data"
    advice = model.advise(b)
    assert advice[0].feature == "CrossEpochLoader" and advice[0].trial == "cross-epoch-loader"
    assert advice[0].gain_s == pytest.approx(85 * MS)
    assert advice[1].feature == "more DataLoader workers" and not advice[1].aiak


def test_data_bound_without_workers_advises_workers_first():
    recs = [record(data=90, data_epoch_start=10, forward=1, backward=1)] * 10
    loader = {"num_workers": 0, "persistent_workers": False, "map_style": True, "batches": 9}
    advice = model.advise(model.breakdown([report(recs, loaders=[loader])]))
    assert advice[0].feature == "DataLoader workers" and advice[0].gain_s == pytest.approx(
        90 * MS * 3 / 4
    )
    assert "CrossEpochLoader" not in [a.feature for a in advice]


def test_host_bound_small_model_is_told_so_and_gets_no_aiak_feature_first():
    recs = [record(forward=4, backward=8, optimizer=0.1)] * 10
    # a few thousand elements and multiply-adds: microseconds of work in 12 ms
    work = {"forward": [7000, 8000], "backward": [25000, 15000]}
    b = model.breakdown([report(recs, work=work, ops={"forward": 240, "backward": 724})])
    assert b.bottleneck() == "host"
    assert b.host["compute"] > 0.99
    first = model.advise(b)[0]
    assert first.feature == "larger batch, or CUDA graphs" and not first.aiak
    assert first.gain_s == pytest.approx(b.compute * b.host["compute"] / 2)


def test_compute_bound_cpu_step_gets_no_advice():
    recs = [record(forward=40, backward=80, optimizer=1)] * 10
    work = {"forward": [10**6, 8 * 10**8], "backward": [2 * 10**6, 16 * 10**8]}
    b = model.breakdown([report(recs, work=work)])
    assert b.bottleneck() == "compute"
    assert model.advise(b) == []


_ms = st.floats(min_value=0.0, max_value=200.0)


@given(
    data=_ms,
    start=st.floats(0.0, 1.0),
    forward=_ms,
    backward=_ms,
    comm=st.floats(0.0, 1.0),
    optimizer=_ms,
    other=_ms,
    world=st.sampled_from([1, 2, 8, 16]),
    local=st.sampled_from([1, 2, 8]),
    workers=st.sampled_from([0, 2]),
    ops=st.integers(0, 10**5),
)
def test_every_gain_is_bounded_by_its_phase_and_the_advice_is_ranked(
    data, start, forward, backward, comm, optimizer, other, world, local, workers, ops
):
    step = data + forward + backward + optimizer + other
    rec = record(
        data=data,
        data_epoch_start=data * start,
        forward=forward,
        backward=backward,
        comm=backward * comm,
        optimizer=optimizer,
        step=step,
    )
    loader = {"num_workers": workers, "map_style": True, "batches": 4}
    r = report([rec] * 5, world=world, local=local, ops={"optimizer": ops}, loaders=[loader])
    if step == 0:
        return
    b = model.breakdown([r])
    assert sum(b.share(p) for p in attribution.PHASES) == pytest.approx(1.0)
    advice = model.advise(b)
    bound = {"data": b.data, "optimizer": b.optimizer, "comm": b.comm, "compute": b.compute}
    for a in advice:
        if a.gain_s is not None:
            assert 0 <= a.gain_s <= bound[a.phase] * (1 + 1e-9) + 1e-12
            assert a.gain_s >= model.MIN_GAIN * b.step
    keys = [a.rank_key(b.step) for a in advice]
    assert keys == sorted(keys)
    doc = report_text.document(b, advice, {"steps": 5})
    assert json.loads(json.dumps(doc))["breakdown"]["bottleneck"] == b.bottleneck()


def test_text_report_names_bottleneck_gain_flags_and_limits():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    ddp = [{"bucket_cap_bytes": 25 * 2**20}]
    b = model.breakdown([report(recs, world=2, local=2, grad_bytes=4 * 2**20, buckets=2, ddp=ddp)])
    text = report_text.text(b, model.advise(b), {"warmup": 5})
    assert "bottleneck: link" in text
    assert " 1. fp16 gradient compression [aiak]  -40.0 ms (40% of the step)" in text
    assert "use: aiakrun --fp16-compression" in text
    assert "will not help:" in text
    assert "DDP 2 bucket(s), 4.00 MiB of gradients per step" in text
    assert "AMP: none" in text


def test_text_report_notes_ranks_that_ended_early():
    b = model.breakdown([report([record(forward=5, backward=9, optimizer=5)] * 10)])
    text = report_text.text(b, [], {"warmup": 5, "incomplete_ranks": [1]})
    assert "rank(s) [1] ended before the last measured step" in text
    assert "nothing in aiak's cost model saves 2% of this step" in text


def test_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    recs = [record(forward=5, backward=9, optimizer=5)] * 10
    b = model.breakdown([report(recs)])
    monkeypatch.setattr(report_text.importlib.util, "find_spec", lambda name: None)
    why = report_text.draw(str(tmp_path / "x.png"), [("before", b)])
    assert why is not None and "matplotlib" in why
    assert not (tmp_path / "x.png").exists()


def test_on_cuda_the_host_share_of_compute_is_the_gpu_idle_share():
    recs = [record(forward=4, backward=8, optimizer=0.1)] * 10
    r = {**report(recs), "cuda": True, "stream_samples": 100, "stream_empty": 70}
    b = model.breakdown([r])
    assert b.gpu_idle == pytest.approx(0.7) and b.host["compute"] == pytest.approx(0.7)
    assert b.bottleneck() == "host"
    busy = model.breakdown([{**r, "stream_empty": 10}])
    assert busy.bottleneck() == "compute"
    assert [a.feature for a in model.advise(busy)] == ["O2 mixed precision"]
    r["facts"] = {**r["facts"], "autocast": "cuda:float16"}  # mixed precision already
    assert model.advise(model.breakdown([{**r, "stream_empty": 10}])) == []


def test_png_of_before_and_after(tmp_path):
    pytest.importorskip("matplotlib")
    b = model.breakdown([report([record(forward=5, backward=9, optimizer=5)] * 10)])
    assert report_text.draw(str(tmp_path / "x.png"), [("before", b), ("after", b)]) is None
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_timed_link_splits_exposed_comm_into_bytes_and_waiting():
    recs = [record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    # 4 MiB at 20 ns per byte: 84 ms > 80 ms exposed: all of it is bytes
    link = {"latency_s": 0.5 * MS, "s_per_byte": 20e-9}
    slow = model.breakdown([report(recs, world=2, local=2, grad_bytes=4 * 2**20, link=link)])
    assert slow.comm_split() == (pytest.approx(80 * MS), 0.0)
    assert slow.bottleneck() == "link"
    assert model.advise(slow)[0].gain_s == pytest.approx(40 * MS)
    # the same exposed comm on a link that moves the bytes in 4 ms: the ranks wait ~75 ms
    fast = {"latency_s": 0.5 * MS, "s_per_byte": 1e-9}
    b = model.breakdown(
        [report(recs, world=2, local=2, grad_bytes=4 * 2**20, buckets=1, link=fast)]
    )
    moved, wait = b.comm_split()
    assert moved == pytest.approx(4 * 2**20 * 1e-9)
    assert wait == pytest.approx(80 * MS - 0.5 * MS - moved)
    assert b.bottleneck() == "ranks"
    advice = model.advise(b)
    assert advice[0].feature == "fp16 gradient compression"
    assert advice[0].gain_s == pytest.approx(moved / 2)  # halves the bytes' part only
    check = next(a for a in advice if a.feature == "slow-rank check")
    assert check.gain_s is None and not check.flags and "--perf-check-n-steps" in check.use
