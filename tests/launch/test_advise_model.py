"""aiak-advise's attribution and cost model on hand-written rank reports (no process)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiak.launch import _advise_model as model
from aiak.launch import _advise_report as report

MS = 1e-3


def _record(**phases: float) -> dict[str, float]:
    rec = dict.fromkeys(("data", "data_epoch_start", "forward", "backward", "comm"), 0.0)
    rec["optimizer"] = 0.0
    rec.update({k: v * MS for k, v in phases.items()})
    rec.setdefault("step", sum(rec[k] for k in ("data", "forward", "backward", "optimizer")))
    return rec


def _report(records, rank=0, world=1, local=1, ops=None, work=None, **facts):
    base = {
        "optimizer": {
            "type": "AdamW",
            "module": "torch.optim.adamw",
            "groups": 1,
            "tensors": 4,
            "parameters": 1_050_112,
            "dtypes": ["float32"],
            "foreach": None,
            "fused": None,
            "shapes": [[1024, 512], [1024], [512, 1024], [512]],
            "device": "cpu",
        },
        "loaders": [],
        "ddp": [],
    }
    base.update(facts)
    return {
        "rank": rank,
        "world": world,
        "local_world": local,
        "backend": "gloo" if world > 1 else None,
        "cuda": False,
        "complete": True,
        "warmup": 5,
        "steps_seen": 5 + len(records),
        "records": records,
        "ops": ops or {"forward": 10, "backward": 20, "optimizer": 40},
        "work": work or {"forward": [10**6, 10**8], "backward": [2 * 10**6, 2 * 10**8]},
        "rates": {"elem_s": 1e-9, "mac_s": 5e-11},
        "op_cost_s": 5e-6,
        "facts": base,
    }


def test_phases_add_up_to_the_trimmed_step():
    recs = [_record(forward=2, backward=3, optimizer=1) for _ in range(8)]
    recs += [_record(forward=200, backward=3, optimizer=1), _record(forward=0.5, backward=0.5)]
    b = model.breakdown([_report(recs)])
    # the slowest and fastest fifth (one step each of ten) are dropped
    assert b.step == pytest.approx(6 * MS)
    assert b.forward + b.backward + b.optimizer + b.data + b.other == pytest.approx(b.step)
    assert b.steps == 10


def test_no_measured_step_is_a_clear_error():
    with pytest.raises(ValueError, match=r"finished 3 optimizer step\(s\), the warm-up is 5"):
        model.breakdown([{**_report([]), "steps_seen": 3}])
    with pytest.raises(ValueError, match="no rank wrote a report"):
        model.breakdown([])


def test_ranks_are_averaged():
    a = _report([_record(forward=2, backward=2)] * 5, rank=0, world=2)
    b = _report([_record(forward=4, backward=4)] * 5, rank=1, world=2)
    assert model.breakdown([a, b]).step == pytest.approx(6 * MS)


def test_link_bound_two_ranks_advises_fp16_first_and_powersgd_after():
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    facts = {"buckets": 2, "grad_bytes": 4 * 2**20, "ddp": [{"bucket_cap_bytes": 25 * 2**20}]}
    b = model.breakdown([_report(recs, world=2, local=2, **facts)])
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
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    b = model.breakdown([_report(recs, world=2, local=2, grad_bytes=4 * 2**20)])
    on = {"AIAK_FP16_COMPRESSION": "1"}
    assert not [a for a in model.advise(b, on) if a.phase == "comm"]


def test_two_nodes_get_the_hierarchical_allreduce_with_its_bytes_ratio():
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    b = model.breakdown([_report(recs, world=8, local=4, grad_bytes=2**20)])
    hier = next(a for a in model.advise(b) if a.feature == "hierarchical allreduce")
    # through a node's link: the flat ring 2 x 7/8 of the gradients, two levels 2 x 1/2
    assert hier.gain_s == pytest.approx(80 * MS * (1 - (1 / 2) / (7 / 8)))
    assert hier.flags == ("--hierarchical-allreduce",) and not hier.changes_update


def test_dgc_only_for_sgd():
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    opt = {**_report([])["facts"]["optimizer"], "type": "SGD", "module": "torch.optim.sgd"}
    b = model.breakdown([_report(recs, world=2, local=2, optimizer=opt)])
    dgc = next(a for a in model.advise(b) if a.feature == "DGC")
    assert dgc.gain_s == pytest.approx(80 * MS * (1 - 2 * 0.001 * 12 / 8))


def test_optimizer_bound_advises_the_fused_optimizer_from_its_op_cost():
    recs = [_record(forward=1, backward=2, optimizer=40)] * 10
    opt = {**_report([])["facts"]["optimizer"], "tensors": 400, "type": "Adam"}
    ops = {"forward": 3, "backward": 800, "optimizer": 4000}
    b = model.breakdown([_report(recs, ops=ops, optimizer=opt)])
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
    recs = [_record(forward=1, backward=2, optimizer=40)] * 10
    o = {**_report([])["facts"]["optimizer"], "tensors": 400, **opt}
    b = model.breakdown([_report(recs, ops={"optimizer": 4000}, optimizer=o)])
    assert not [a for a in model.advise(b) if a.phase == "optimizer"]


def test_foreach_optimizer_gain_comes_from_its_few_ops():
    recs = [_record(forward=1, backward=2, optimizer=40)] * 10
    o = {**_report([])["facts"]["optimizer"], "tensors": 400, "foreach": True}
    b = model.breakdown([_report(recs, ops={"optimizer": 12}, optimizer=o)])
    # 12 multi-tensor ops x 5 us: 60 us of 43 ms, under the 2% worth advising
    assert not [a for a in model.advise(b) if a.phase == "optimizer"]


def test_data_bound_at_epoch_starts_advises_cross_epoch_loader():
    recs = [_record(data=90, data_epoch_start=85, forward=1, backward=1)] * 10
    loader = {"num_workers": 2, "persistent_workers": False, "map_style": True, "batches": 2}
    b = model.breakdown([_report(recs, loaders=[loader])])
    assert b.bottleneck() == "data"
    advice = model.advise(b)
    assert advice[0].feature == "CrossEpochLoader" and advice[0].trial == "cross-epoch-loader"
    assert advice[0].gain_s == pytest.approx(85 * MS)
    assert advice[1].feature == "more DataLoader workers" and not advice[1].aiak


def test_data_bound_without_workers_advises_workers_first():
    recs = [_record(data=90, data_epoch_start=10, forward=1, backward=1)] * 10
    loader = {"num_workers": 0, "persistent_workers": False, "map_style": True, "batches": 9}
    advice = model.advise(model.breakdown([_report(recs, loaders=[loader])]))
    assert advice[0].feature == "DataLoader workers" and advice[0].gain_s == pytest.approx(
        90 * MS * 3 / 4
    )
    assert "CrossEpochLoader" not in [a.feature for a in advice]


def test_host_bound_small_model_is_told_so_and_gets_no_aiak_feature_first():
    recs = [_record(forward=4, backward=8, optimizer=0.1)] * 10
    # a few thousand elements and multiply-adds: microseconds of work in 12 ms
    work = {"forward": [7000, 8000], "backward": [25000, 15000]}
    b = model.breakdown([_report(recs, work=work, ops={"forward": 240, "backward": 724})])
    assert b.bottleneck() == "host"
    assert b.host["compute"] > 0.99
    first = model.advise(b)[0]
    assert first.feature == "larger batch, or CUDA graphs" and not first.aiak
    assert first.gain_s == pytest.approx(b.compute * b.host["compute"] / 2)


def test_compute_bound_cpu_step_gets_no_advice():
    recs = [_record(forward=40, backward=80, optimizer=1)] * 10
    work = {"forward": [10**6, 8 * 10**8], "backward": [2 * 10**6, 16 * 10**8]}
    b = model.breakdown([_report(recs, work=work)])
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
    rec = _record(
        data=data,
        data_epoch_start=data * start,
        forward=forward,
        backward=backward,
        comm=backward * comm,
        optimizer=optimizer,
        step=step,
    )
    loader = {"num_workers": workers, "map_style": True, "batches": 4}
    r = _report([rec] * 5, world=world, local=local, ops={"optimizer": ops}, loaders=[loader])
    if step == 0:
        return
    b = model.breakdown([r])
    assert sum(b.share(p) for p in model.PHASES) == pytest.approx(1.0)
    advice = model.advise(b)
    bound = {"data": b.data, "optimizer": b.optimizer, "comm": b.comm, "compute": b.compute}
    for a in advice:
        if a.gain_s is not None:
            assert 0 <= a.gain_s <= bound[a.phase] * (1 + 1e-9) + 1e-12
            assert a.gain_s >= model.MIN_GAIN * b.step
    keys = [a.rank_key(b.step) for a in advice]
    assert keys == sorted(keys)
    doc = report.document(b, advice, {"steps": 5})
    assert json.loads(json.dumps(doc))["breakdown"]["bottleneck"] == b.bottleneck()


def test_text_report_names_bottleneck_gain_flags_and_limits():
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    ddp = [{"bucket_cap_bytes": 25 * 2**20}]
    b = model.breakdown([_report(recs, world=2, local=2, grad_bytes=4 * 2**20, buckets=2, ddp=ddp)])
    text = report.text(b, model.advise(b), {"warmup": 5})
    assert "bottleneck: link" in text
    assert " 1. fp16 gradient compression [aiak]  -40.0 ms (40% of the step)" in text
    assert "use: aiakrun --fp16-compression" in text
    assert "will not help:" in text
    assert "DDP 2 bucket(s), 4.00 MiB of gradients per step" in text
    assert "AMP: none" in text


def test_text_report_notes_ranks_that_ended_early():
    b = model.breakdown([_report([_record(forward=5, backward=9, optimizer=5)] * 10)])
    text = report.text(b, [], {"warmup": 5, "incomplete_ranks": [1]})
    assert "rank(s) [1] ended before the last measured step" in text
    assert "nothing in aiak's cost model saves 2% of this step" in text


def test_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    recs = [_record(forward=5, backward=9, optimizer=5)] * 10
    b = model.breakdown([_report(recs)])
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    why = report.draw(str(tmp_path / "x.png"), [("before", b)])
    assert why is not None and "matplotlib" in why
    assert not (tmp_path / "x.png").exists()


def test_on_cuda_the_host_share_of_compute_is_the_gpu_idle_share():
    recs = [_record(forward=4, backward=8, optimizer=0.1)] * 10
    r = {**_report(recs), "cuda": True, "stream_samples": 100, "stream_empty": 70}
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
    b = model.breakdown([_report([_record(forward=5, backward=9, optimizer=5)] * 10)])
    assert report.draw(str(tmp_path / "x.png"), [("before", b), ("after", b)]) is None
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_timed_link_splits_exposed_comm_into_bytes_and_waiting():
    recs = [_record(forward=5, backward=90, comm=80, optimizer=5)] * 10
    # 4 MiB at 20 ns per byte: 84 ms > 80 ms exposed: all of it is bytes
    link = {"latency_s": 0.5 * MS, "s_per_byte": 20e-9}
    slow = model.breakdown([_report(recs, world=2, local=2, grad_bytes=4 * 2**20, link=link)])
    assert slow.comm_split() == (pytest.approx(80 * MS), 0.0)
    assert slow.bottleneck() == "link"
    assert model.advise(slow)[0].gain_s == pytest.approx(40 * MS)
    # the same exposed comm on a link that moves the bytes in 4 ms: the ranks wait ~75 ms
    fast = {"latency_s": 0.5 * MS, "s_per_byte": 1e-9}
    b = model.breakdown(
        [_report(recs, world=2, local=2, grad_bytes=4 * 2**20, buckets=1, link=fast)]
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


# -- CUDA: the GPU's clock and the GPU rules ---------------------------------------------------


def _cuda(records, gpu, facts=None, amp=None, copy=2.5e12, opt_empty=0, **kw):
    """A CUDA rank report: host ``records``, each with the GPU intervals ``gpu`` (ms)."""
    recs = [{**r, "gpu": {k: v * MS for k, v in gpu.items()}} for r in records]
    r = _report(recs, **(facts or {}))
    r.update(cuda=True, stream_samples=100, stream_empty=5, opt_samples=20, opt_empty=opt_empty)
    r["rates"] = {**r["rates"], "copy_Bps": copy}
    r["amp"] = amp or {}
    r["facts"]["optimizer"] = {**r["facts"]["optimizer"], "device": "cuda", **kw}
    return r


# ResNet-50 b128 under O1 on an H100 (docs/advise.md): the host runs ahead, then waits in
# GradScaler.step's .item() for the backward's GPU work: 13.8 ms "other" on the host's clock
_RESNET_HOST = _record(data=0.0, forward=4.0, backward=3.5, optimizer=1.1, step=29.8)
_RESNET_GPU = {"data": 0.0, "forward": 9.5, "backward": 17.5, "optimizer": 1.6, "step": 29.8}
_SGD = {
    "type": "SGD",
    "module": "torch.optim.sgd",
    "tensors": 161,
    "parameters": 25_557_032,
    "foreach": True,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "nesterov": False,
    "amp_scaling": False,
    "grad_scaler": True,
}


def test_on_cuda_the_phases_are_the_gpu_intervals_and_the_hosts_wait_is_not_other():
    host_only = model.breakdown(
        [{**_cuda([_RESNET_HOST] * 10, _RESNET_GPU), "records": [_RESNET_HOST] * 10}]
    )
    assert host_only.clock == "host"
    assert host_only.other == pytest.approx(21.2 * MS)  # the host's view: the wait is "other"
    b = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU)])
    assert b.clock == "gpu"
    assert (b.forward, b.backward, b.optimizer) == pytest.approx((9.5 * MS, 17.5 * MS, 1.6 * MS))
    assert b.other == pytest.approx(1.2 * MS)
    assert b.step == pytest.approx(29.8 * MS)
    assert b.bottleneck() == "compute"
    assert b.host_s["optimizer"] == pytest.approx(1.1 * MS)
    text = report.text(b, [], {"warmup": 5})
    assert "phases on the GPU's clock" in text and "optimizer 1.1 ms" in text


def test_gpu_clock_needs_every_measured_step_read():
    recs = [{**_RESNET_HOST, "gpu": {k: v * MS for k, v in _RESNET_GPU.items()}}] * 9
    r = _cuda([_RESNET_HOST], _RESNET_GPU)
    r["records"] = [*recs, _RESNET_HOST]  # one step's events never read: the host's clock
    assert model.breakdown([r]).clock == "host"


@pytest.mark.parametrize(
    ("opt", "passes"),
    [
        ({"type": "SGD"}, (3, 3)),
        ({"type": "SGD", "momentum": 0.9}, (8, 5)),
        ({"type": "SGD", "momentum": 0.9, "weight_decay": 1e-4}, (11, 5)),
        ({"type": "SGD", "momentum": 0.9, "nesterov": True}, (11, 5)),
        ({"type": "SGD", "nesterov": True}, (3, 3)),  # nesterov needs momentum
        ({"type": "Adam"}, (18, 7)),
        ({"type": "Adam", "weight_decay": 0.1}, (21, 7)),
        ({"type": "AdamW", "weight_decay": 0.05}, (20, 7)),
    ],
)
def test_optimizer_passes_over_the_state(opt, passes):
    assert model.optimizer_passes(opt) == passes


def test_fused_optimizer_on_cuda_counts_the_state_passes_and_the_scalers_sync():
    b = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU, opt_empty=20, **_SGD)])
    fused = next(a for a in model.advise(b) if a.feature == "fused optimizer")
    work = (11 - 5) * 4 * 25_557_032 / 2.5e12  # 0.25 ms of the GPU's passes
    # the queue empty at the optimizer's start in every step: the GPU waits for its 1.1 ms
    assert fused.gain_s == pytest.approx(work + 1.1 * MS)
    assert fused.flags == ("--fuse-optimizer",) and "GradScaler" in fused.why
    # half the steps found the queue empty: half the wait
    half = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU, opt_empty=10, **_SGD)])
    assert model.advise(half)[0].gain_s == pytest.approx(work + 0.55 * MS)
    # never bounded beyond the optimizer's own interval on the GPU
    gpu = {**_RESNET_GPU, "optimizer": 0.9}
    small = model.breakdown([_cuda([_RESNET_HOST] * 10, gpu, opt_empty=20, **_SGD)])
    assert model.advise(small)[0].gain_s == pytest.approx(0.9 * MS)


def test_fused_optimizer_on_cuda_without_a_scaler_waits_only_for_the_ops_host_cost():
    opt = {**_SGD, "grad_scaler": False}
    b = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU, opt_empty=20, **opt)])
    fused = model._fused_on_gpu(b, b.facts["optimizer"], 161, 1)
    work = (11 - 5) * 4 * 25_557_032 / 2.5e12
    host_cost = 40 * 5e-6  # the report's 40 optimizer ops x 5 us
    assert fused.gain_s == pytest.approx(work + host_cost * (1 - 1 / 161))
    # 0.45 ms of a 29.8 ms step: under the 2% worth advising
    assert "fused optimizer" not in [a.feature for a in model.advise(b)]


def test_fused_optimizer_on_a_host_bound_gpu_counts_the_ops_host_cost_where_the_gpu_idles():
    # Adam's per-tensor loop over 400 small tensors: the GPU idles at 80% of the boundaries
    # though the queue was never seen empty at the optimizer's start
    opt = {"type": "Adam", "tensors": 400, "parameters": 6400, "foreach": False}
    host = _record(forward=1, backward=2, optimizer=40, step=45)
    gpu = {"forward": 1.5, "backward": 2.5, "optimizer": 40.0, "step": 45.0}
    r = _cuda([host] * 10, gpu, opt_empty=0, **opt)
    r.update(stream_empty=80, ops={"optimizer": 4000})
    b = model.breakdown([r])
    fused = next(a for a in model.advise(b) if a.feature == "fused optimizer")
    work = (18 - 7) * 4 * 6400 / 2.5e12
    # 4000 ops x 5 us = 20 ms of host cost, x 0.8 exposed, one group of 400 keeps 1/400
    assert fused.gain_s == pytest.approx(work + 20 * MS * 0.8 * (1 - 1 / 400))


@pytest.mark.parametrize("opt", [{"fused": True}, {"type": "RMSprop"}])
def test_no_fused_optimizer_on_cuda_without_a_twin(opt):
    o = {**_SGD, **opt}
    b = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU, opt_empty=20, **o)])
    assert not [a for a in model.advise(b) if a.feature == "fused optimizer"]


# Swin-T b64 under O1, counted by hand from timm's block (docs/advise.md): per step ~320M
# activation elements cast each way (LayerNorm outputs and softmax to half, their grads back),
# ~700M fp32 elements written forward (LayerNorms, the fp32 residual stream, bias + mask adds
# and softmax over the scores) and ~600M backward; 28M weights cast each way
_SWIN_HOST = _record(forward=20.0, backward=3.0, optimizer=0.9, step=54.0)
_SWIN_GPU = {"forward": 17.0, "backward": 34.0, "optimizer": 1.0, "step": 54.0}
_AMP = {
    "forward": [323_000_000 + 28_000_000, 28_000_000, 713_000_000],
    "backward": [320_000_000 + 28_000_000, 0, 600_000_000],
}


def test_o2_from_autocast_is_estimated_from_the_casts_and_fp32_elements():
    facts = {"autocast": "cuda:float16"}
    b = model.breakdown([_cuda([_SWIN_HOST] * 10, _SWIN_GPU, facts, amp=_AMP)])
    saved, activation, fp32 = model.o2_bytes(_AMP)
    # the weights' casts (28M each way) are O2's master copies: only the activations count
    assert activation == 643_000_000 and fp32 == 1_313_000_000
    assert saved == 6 * 643_000_000 + 4 * 1_313_000_000
    o2 = next(a for a in model.advise(b) if a.feature == "O2 mixed precision")
    assert o2.gain_s == pytest.approx(saved / 2.5e12 * (1 - 0.05))  # the GPU busy 95%
    assert o2.trial == "o2" and "aiak.amp.decorate" in o2.use
    assert "weight casts" in o2.not_helps


def test_o2_is_not_advised_where_it_changes_no_bytes_or_is_on():
    facts = {"autocast": "cuda:float16"}
    # ResNet-like: the input image is the one activation cast; everything else is half
    resnet = {"forward": [19_267_584 + 25_000_000, 25_000_000, 100], "backward": [25_000_000, 0, 0]}
    b = model.breakdown([_cuda([_RESNET_HOST] * 10, _RESNET_GPU, facts, amp=resnet, **_SGD)])
    assert "O2 mixed precision" not in [a.feature for a in model.advise(b)]
    decorated = model.breakdown(
        [_cuda([_SWIN_HOST] * 10, _SWIN_GPU, facts, amp=_AMP, aiak_o2=True)]
    )
    assert "O2 mixed precision" not in [a.feature for a in model.advise(decorated)]
    tried = {**facts, "trials": {"o2": "applied"}}
    b = model.breakdown([_cuda([_SWIN_HOST] * 10, _SWIN_GPU, tried, amp=_AMP)])
    assert "O2 mixed precision" not in [a.feature for a in model.advise(b)]


def test_o2_without_a_copy_rate_is_advised_unestimated():
    facts = {"autocast": "cuda:bfloat16"}
    b = model.breakdown([_cuda([_SWIN_HOST] * 10, _SWIN_GPU, facts, amp=_AMP, copy=0.0)])
    o2 = next(a for a in model.advise(b) if a.feature == "O2 mixed precision")
    assert o2.gain_s is None and "no copy rate" in o2.why


@pytest.mark.parametrize(
    ("sdpa", "per_score"),
    [
        (0, 190 * (1 - 1 / 3.08)),  # timm's eager maths: 6.8 ms of 54 saved
        (12, 135 * (1 - 1 / 2.28)),  # timm's fused_attn (SDPA): 4.0 ms
        (6, (190 * (1 - 1 / 3.08) + 135 * (1 - 1 / 2.28)) / 2),
    ],
)
def test_window_attention_is_advised_from_its_score_elements(sdpa, per_score):
    wa = {"modules": 12, "sdpa": sdpa, "fused": 0, "dropout": 0, "scores": 140_000_000}
    b = model.breakdown([_cuda([_SWIN_HOST] * 10, _SWIN_GPU, {"window_attention": wa})])
    advice = model.advise(b)
    fused = next(a for a in advice if a.feature == "fused window attention")
    assert fused.gain_s == pytest.approx(140_000_000 * per_score / 2.5e12 * 0.95)
    assert fused.trial == "swin-convert" and "swin.convert(model)" in fused.use
    assert advice[0] is fused  # the largest estimated gain here


@pytest.mark.parametrize(
    ("wa", "cuda", "advised"),
    [
        ({"modules": 0, "fused": 12, "dropout": 0, "scores": 0}, True, False),  # converted
        ({"modules": 12, "fused": 0, "dropout": 0, "scores": 10**8}, False, False),  # CPU
    ],
)
def test_window_attention_not_advised_when_fused_or_on_cpu(wa, cuda, advised):
    r = _cuda([_SWIN_HOST] * 10, _SWIN_GPU, {"window_attention": wa})
    r["cuda"] = cuda
    b = model.breakdown([r])
    assert ("fused window attention" in [a.feature for a in model.advise(b)]) == advised


def test_window_attention_without_counted_scores_is_unestimated_with_the_reason():
    wa = {"modules": 12, "fused": 0, "dropout": 0, "scores": 0}
    b = model.breakdown([_cuda([_SWIN_HOST] * 10, _SWIN_GPU, {"window_attention": wa})])
    fused = next(a for a in model.advise(b) if a.feature == "fused window attention")
    assert fused.gain_s is None and "no score elements were counted" in fused.why


# -- CUDA, several nodes: the exposed comm on the GPU's clock ---------------------------------


def _resnet50_shapes() -> list[list[int]]:
    """ResNet-50's parameter shapes (torchvision's layout): stem, 16 bottlenecks, fc."""
    shapes = [[64, 3, 7, 7], [64], [64]]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * width
        for i in range(blocks):
            shapes += [[width, cin, 1, 1], [width], [width], [width, width, 3, 3]]
            shapes += [[width], [width], [out, width, 1, 1], [out], [out]]
            if i == 0:
                shapes += [[out, cin, 1, 1], [out], [out]]
            cin = out
    return [*shapes, [1000, 2048], [1000]]


# ResNet-50 b32, 2 nodes x 1 H200, NCCL over sockets at ~2.8 GB/s, DDP's allreduce of 97 MiB in
# 5 buckets (benchmarks/results/advise/resnet50-2nodes-x1.txt): the host queues the allreduce
# and sees 1.3 ms of it; the compute stream waits ~35 ms for it at the backward's end
_NODES_HOST = _record(forward=10.7, backward=16.6, comm=1.3, optimizer=1.0, step=57.5)
_NODES_GPU = {"forward": 11.0, "backward": 43.8, "comm": 35.0, "optimizer": 0.3, "step": 57.5}
_GRAD_BYTES = 25_557_032 * 4
_LINK = {"latency_s": 0.2 * MS, "s_per_byte": 1 / 2.8e9}  # the allreduce of 97 MiB: 36.5 ms


def _two_nodes(world: int = 2, local: int = 1, gpu=None) -> list[dict]:
    opt = {**_SGD, "grad_scaler": False, "shapes": _resnet50_shapes()}
    facts = {
        "buckets": 5,
        "grad_bytes": _GRAD_BYTES,
        "ddp": [{"bucket_cap_bytes": 25 * 2**20}],
        "link": _LINK,
    }
    out = []
    for rank in range(2):
        r = _cuda([_NODES_HOST] * 12, gpu or _NODES_GPU, facts, **opt)
        r.update(rank=rank, world=world, local_world=local, backend="nccl")
        out.append(r)
    return out


def test_resnet50_shapes_are_torchvisions():
    shapes = _resnet50_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032


def test_nccl_job_on_two_nodes_is_link_bound_on_the_gpus_clock():
    b = model.breakdown(_two_nodes())
    assert b.clock == "gpu" and b.ranks == 2
    assert b.comm == pytest.approx(35.0 * MS)  # the GPU's, not the host's 1.3 ms
    assert b.host_s["comm"] == pytest.approx(1.3 * MS)
    assert b.compute == pytest.approx((11.0 + 43.8 - 35.0) * MS)
    # 97 MiB at 2.8 GB/s take 36.5 ms: all of the exposed comm is bytes, none is waiting
    assert b.comm_split() == (pytest.approx(35.0 * MS), 0.0)
    assert b.bottleneck() == "link"
    text = report.text(b, model.advise(b), {"warmup": 5})
    assert "comm 35.0 ms (61%)" in text and "bottleneck: link" in text
    # a ring of 2 sends the gradients' bytes once: 102 MB in 35 ms, near the link's rate
    assert f"exposed comm at {_GRAD_BYTES / 35.0e-3 / 1e6:.0f} MB/s effective" in text
    assert "comm 1.3 ms" in text  # the host's, on the host's line


def test_nccl_job_on_two_nodes_gets_compression_first_with_its_gain():
    b = model.breakdown(_two_nodes())
    advice = model.advise(b)
    first = advice[0]
    # half the bytes' 35 ms: 57.5 -> 40.0 ms (bench_comm_nodes.py measured fp16 on this job
    # 54.2 -> 39.1 ms against the flat allreduce, results/README.md)
    assert first.feature == "fp16 gradient compression"
    assert first.gain_s == pytest.approx(17.5 * MS) and first.flags == ("--fp16-compression",)
    gains = {a.feature: a.gain_s for a in advice}
    # DGC and PowerSGD send far fewer bytes, but not below the host's own 27.0 ms of the step
    # (forward 10.7 + backward 16.6 - its comm 1.3 + optimizer 1.0), and they change the update
    floor = (10.7 + 16.6 - 1.3 + 1.0) * MS
    assert b.host_floor() == pytest.approx(floor)
    assert gains["DGC"] == pytest.approx(57.5 * MS - floor)
    assert gains["PowerSGD (rank 2)"] == pytest.approx(57.5 * MS - floor)
    assert "at most 30.5 ms" in next(a for a in advice if a.feature == "DGC").why
    assert {a.feature for a in advice[1:3]} == {"DGC", "PowerSGD (rank 2)"}
    # one GPU a node: no intra-node level to take bytes off the link
    assert "hierarchical allreduce" not in gains
    # the GPU's optimizer is 0.3 ms: nothing to advise there
    assert "fused optimizer" not in gains


def test_two_nodes_of_two_gpus_get_the_hierarchical_allreduce_too():
    b = model.breakdown(_two_nodes(world=4, local=2))
    hier = next(a for a in model.advise(b) if a.feature == "hierarchical allreduce")
    # through a node's link: the flat ring 2 x 3/4 of the gradients, two levels 2 x 1/2
    assert hier.gain_s == pytest.approx(35.0 * MS * (1 - 1 / 1.5))
    assert model.advise(b)[0].feature == "fp16 gradient compression"


def test_exposed_comm_without_gpu_events_keeps_the_hosts_measure():
    gpu = {k: v for k, v in _NODES_GPU.items() if k != "comm"}
    b = model.breakdown(_two_nodes(gpu=gpu))
    assert b.clock == "gpu" and b.comm == pytest.approx(1.3 * MS)
    # what a report without the hooks' events says of this job (the mislabel of the 2-node
    # report): compute-bound, compression worth at most the host's 1.3 ms
    assert b.bottleneck() == "compute"
    assert all(a.gain_s <= 1.3 * MS for a in model.advise(b) if a.phase == "comm")
