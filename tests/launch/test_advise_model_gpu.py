"""aiak-advise on CUDA rank reports (no process): the GPU's clock, the GPU rules (O2, the
fused optimizer's state passes and sync, window attention) and the exposed comm of NCCL jobs."""

from __future__ import annotations

import math

import pytest
from _advise_reports import MS, record, report

from aiak.conformance.shapes import RESNET50
from aiak.launch import _advise_model as model
from aiak.launch import _advise_report as report_text

# -- CUDA: the GPU's clock and the GPU rules ---------------------------------------------------


def _cuda(records, gpu, facts=None, amp=None, copy=2.5e12, opt_empty=0, **kw):
    """A CUDA rank report: host ``records``, each with the GPU intervals ``gpu`` (ms)."""
    recs = [{**r, "gpu": {k: v * MS for k, v in gpu.items()}} for r in records]
    r = report(recs, **(facts or {}))
    r.update(cuda=True, stream_samples=100, stream_empty=5, opt_samples=20, opt_empty=opt_empty)
    r["rates"] = {**r["rates"], "copy_Bps": copy}
    r["amp"] = amp or {}
    r["facts"]["optimizer"] = {**r["facts"]["optimizer"], "device": "cuda", **kw}
    return r


# ResNet-50 b128 under O1 on an H100 (docs/advise.md): the host runs ahead, then waits in
# GradScaler.step's .item() for the backward's GPU work: 13.8 ms "other" on the host's clock
_RESNET_HOST = record(data=0.0, forward=4.0, backward=3.5, optimizer=1.1, step=29.8)
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
    text = report_text.text(b, [], {"warmup": 5})
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
    host = record(forward=1, backward=2, optimizer=40, step=45)
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
_SWIN_HOST = record(forward=20.0, backward=3.0, optimizer=0.9, step=54.0)
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


# ResNet-50 b32, 2 nodes x 1 H200, NCCL over sockets at ~2.8 GB/s, DDP's allreduce of 97 MiB in
# 5 buckets (benchmarks/results/advise/resnet50-2nodes-x1.txt): the host queues the allreduce
# and sees 1.3 ms of it; the compute stream waits ~35 ms for it at the backward's end
_NODES_HOST = record(forward=10.7, backward=16.6, comm=1.3, optimizer=1.0, step=57.5)
_NODES_GPU = {"forward": 11.0, "backward": 43.8, "comm": 35.0, "optimizer": 0.3, "step": 57.5}
_GRAD_BYTES = 25_557_032 * 4
_LINK = {"latency_s": 0.2 * MS, "s_per_byte": 1 / 2.8e9}  # the allreduce of 97 MiB: 36.5 ms


def _two_nodes(world: int = 2, local: int = 1, gpu=None) -> list[dict]:
    opt = {**_SGD, "grad_scaler": False, "shapes": [list(s) for s in RESNET50]}
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
    assert len(RESNET50) == 161
    assert sum(math.prod(s) for s in RESNET50) == 25_557_032


def test_nccl_job_on_two_nodes_is_link_bound_on_the_gpus_clock():
    b = model.breakdown(_two_nodes())
    assert b.clock == "gpu" and b.ranks == 2
    assert b.comm == pytest.approx(35.0 * MS)  # the GPU's, not the host's 1.3 ms
    assert b.host_s["comm"] == pytest.approx(1.3 * MS)
    assert b.compute == pytest.approx((11.0 + 43.8 - 35.0) * MS)
    # 97 MiB at 2.8 GB/s take 36.5 ms: all of the exposed comm is bytes, none is waiting
    assert b.comm_split() == (pytest.approx(35.0 * MS), 0.0)
    assert b.bottleneck() == "link"
    text = report_text.text(b, model.advise(b), {"warmup": 5})
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
