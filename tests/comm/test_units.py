"""Single-process tests: env parsing, argument checks, topology, shard views, pickling."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiak import comm
from aiak.comm import _buckets, _collectives
from aiak.comm import cast as comm_cast
from aiak.comm.env import node_key
from aiak.comm.topology import Topology

# ------------------------------------------------------------------------------------------
# environment variables
# ------------------------------------------------------------------------------------------


def kinds(hook) -> list[str]:
    """The hook tree as type names, outermost first, following inner/outer."""
    out, todo = [], [hook]
    while todo:
        h = todo.pop(0)
        out.append(type(h).__name__.lstrip("_"))
        todo += [getattr(h, a) for a in ("inner", "outer") if hasattr(h, a)]
    return out


def test_env_empty_means_ddp_builtin():
    assert comm.from_env({}) is None


@pytest.mark.parametrize(
    ("env", "tree"),
    [
        ({"AIAK_FP16_COMPRESSION": "1"}, ["Cast", "Allreduce"]),
        ({"PERSEUS_ALLREDUCE_DTYPE": "0"}, ["Cast", "Allreduce"]),
        ({"PERSEUS_ALLREDUCE_DTYPE": "2"}, ["Hierarchical", "Allreduce", "Cast", "Allreduce"]),
        (
            {"AIAK_HIERARCHICAL_ALLREDUCE": "1", "AIAK_FP16_COMPRESSION": "1"},
            ["Cast", "Hierarchical", "Allreduce", "Allreduce"],
        ),
        (
            {
                "AIAK_HIERARCHICAL_ALLREDUCE": "1",
                "AIAK_POWERSGD_COMPRESSION": "1",
                "PERSEUS_ALLREDUCE_NANCHECK": "1",
            },
            ["NanCheck", "Hierarchical", "Allreduce", "PowerSGD"],
        ),
        ({"PERSEUS_ALLREDUCE_STREAMS": "3"}, ["MultiStream", "Allreduce"]),
        (
            {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_STREAMS": "2"},
            ["Hierarchical", "Allreduce", "MultiStream", "Allreduce"],
        ),
    ],
)
def test_env_builds_the_composition(env, tree):
    assert kinds(comm.from_env(env)) == tree


def test_env_values_reach_the_hooks():
    hook = comm.from_env(
        {
            "AIAK_POWERSGD_COMPRESSION": "1",
            "AIAK_MATRIX_APPROXIMATION_RANK": "4",
            "AIAK_START_COMPRESS_ITER": "7",
            "AIAK_COMM_LOG_STEPS": "5",
        }
    )
    assert (hook.state.rank, hook.state.start_iter, hook.state.log_every) == (4, 7, 5)
    fp16 = comm.from_env({"PERSEUS_ALLREDUCE_DTYPE": "0", "PERSEUS_ALLREDUCE_GRADIENT_SCALE": "5"})
    assert fp16.state.scale == 5.0 and fp16.state.dtype == torch.float16
    assert comm.parse_env({"PERSEUS_ALLREDUCE_FUSION": "16"}).fusion_mb == 16
    assert comm.parse_env({"PERSEUS_ALLREDUCE_MODE": "auto"}).mode is None
    assert comm.parse_env({"PERSEUS_ACCUMULATE_N_STEPS": "4"}).accumulate == 4


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AIAK_FP16_COMPRESSION", "yes"),
        ("AIAK_HIERARCHICAL_ALLREDUCE", "2"),
        ("AIAK_MATRIX_APPROXIMATION_RANK", "0"),
        ("AIAK_START_COMPRESS_ITER", "1"),
        ("PERSEUS_ALLREDUCE_DTYPE", "3"),
        ("PERSEUS_ALLREDUCE_MODE", "two"),
        ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "-1"),
        ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "inf"),
        ("PERSEUS_ALLREDUCE_STREAMS", "13"),
        ("PERSEUS_ALLREDUCE_FUSION", "200"),
        ("PERSEUS_ACCUMULATE_N_STEPS", "0"),
        ("GLOO_TIMEOUT_SECONDS", "soon"),
        ("PERSEUS_DOWNSAMPLE_N_ELEMENTS", "x"),
    ],
)
def test_env_malformed_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        comm.parse_env({name: value})


@given(
    st.sampled_from(
        ["AIAK_FP16_COMPRESSION", "PERSEUS_ALLREDUCE_NANCHECK", "AIAK_POWERSGD_COMPRESSION"]
    ),
    st.text(min_size=1, max_size=6).filter(lambda s: s.strip() not in ("", "0", "1")),
)
def test_env_flags_accept_only_0_and_1(name, value):
    with pytest.raises(ValueError, match=name):
        comm.parse_env({name: value})


@pytest.mark.parametrize(
    ("env", "names"),
    [
        (
            {"AIAK_HIERARCHICAL_ALLREDUCE": "1", "PERSEUS_ALLREDUCE_MODE": "0"},
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ),
        (
            {"PERSEUS_ALLREDUCE_DTYPE": "2", "PERSEUS_ALLREDUCE_MODE": "0"},
            "PERSEUS_ALLREDUCE_DTYPE",
        ),
        ({"AIAK_FP16_COMPRESSION": "1", "PERSEUS_ALLREDUCE_DTYPE": "1"}, "AIAK_FP16_COMPRESSION"),
        ({"AIAK_POWERSGD_COMPRESSION": "1", "AIAK_FP16_COMPRESSION": "1"}, "choose one"),
    ],
)
def test_env_contradictions_are_errors(env, names):
    with pytest.raises(ValueError, match=names):
        comm.parse_env(env)


def test_env_perf_check_is_parsed():
    cfg = comm.parse_env({"PERSEUS_PERF_CHECK_N_STEPS": "4", "AIAK_PERF_CHECK_MARGIN": "0.5"})
    assert (cfg.perf_steps, cfg.perf_margin) == (4, 0.5)
    with pytest.raises(ValueError, match="PERSEUS_PERF_CHECK_N_STEPS"):
        comm.parse_env({"PERSEUS_PERF_CHECK_N_STEPS": "-1"})


def test_env_downsampling_builds_the_hook():
    cfg = comm.parse_env({"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4", "PERSEUS_GRADIENT_MOMENTUM": "0.9"})
    assert (cfg.downsample, cfg.momentum) == (4, 0.9)
    hook = comm.from_env({"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4", "PERSEUS_GRADIENT_MOMENTUM": "0.9"})
    assert isinstance(hook.state, comm.DownsampleState)
    assert (hook.state.n, hook.state.momentum) == (4, 0.9)
    assert isinstance(hook.state.inner, comm.AllreduceState)
    nested = comm.from_env({"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2", "AIAK_FP16_COMPRESSION": "1"})
    assert isinstance(nested.state, comm.DownsampleState)
    assert isinstance(nested.state.inner, comm.CastState)
    assert comm.from_env({"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "1"}) is None
    with pytest.raises(ValueError, match="PERSEUS_DOWNSAMPLE_N_ELEMENTS"):
        comm.parse_env({"PERSEUS_GRADIENT_MOMENTUM": "0.5"})
    with pytest.raises(ValueError, match="PERSEUS_GRADIENT_MOMENTUM"):
        comm.parse_env({"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2", "PERSEUS_GRADIENT_MOMENTUM": "0"})


def test_gloo_timeout(monkeypatch):
    monkeypatch.setenv("GLOO_TIMEOUT_SECONDS", "7")
    assert comm.gloo_timeout().total_seconds() == 7
    monkeypatch.setenv("GLOO_TIMEOUT_SECONDS", "0")
    with pytest.raises(ValueError, match="GLOO_TIMEOUT_SECONDS"):
        comm.gloo_timeout()
    monkeypatch.delenv("GLOO_TIMEOUT_SECONDS")
    assert comm.gloo_timeout().total_seconds() == 60


# ------------------------------------------------------------------------------------------
# factory argument checks
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "exc", "arg"),
    [
        (lambda: comm.fp16_compress(scale=0), ValueError, "scale"),
        (lambda: comm.fp16_compress(scale="10"), TypeError, "scale"),
        (lambda: comm.bf16_compress(inner=lambda s, b: None), TypeError, "inner"),
        (lambda: comm.powersgd(rank=0), ValueError, "rank"),
        (lambda: comm.powersgd(rank=1.5), TypeError, "rank"),
        (lambda: comm.powersgd(start_iter=1), ValueError, "start_iter"),
        (lambda: comm.nan_check(action="ignore"), ValueError, "action"),
        (lambda: comm.multi_stream(streams=0), ValueError, "streams"),
        (lambda: comm.multi_stream(streams=2.0), TypeError, "streams"),
        (lambda: comm.hierarchical(inner=comm.powersgd()), TypeError, "inner"),
        (lambda: comm.hierarchical(outer=object()), TypeError, "outer"),
        (lambda: comm.hierarchical(fallback="maybe"), ValueError, "fallback"),
    ],
)
def test_factories_validate_arguments(make, exc, arg):
    with pytest.raises(exc, match=arg):
        make()


def test_powersgd_start_iter_may_be_small_without_memories():
    assert comm.powersgd(start_iter=0, error_feedback=False, warm_start=False).state.start_iter == 0


# ------------------------------------------------------------------------------------------
# topology
# ------------------------------------------------------------------------------------------


def test_topology_from_keys():
    t = Topology(["group:0", "group:0", "group:1", "group:1"], rank=2, local_world_size=2)
    assert t.nodes == ((0, 1), (2, 3)) and t.local_rank == 0 and t.homogeneous
    assert t.inter_ranks(1) == (1, 3)
    assert not t.crosses((0, 1, 2, 3))  # rank 2 sends to 3, same node
    assert t.crosses((0, 1, 2))  # rank 2 wraps around to 0, across the link
    assert Topology(["a", "a", "b", "b"], rank=1).crosses((0, 1, 2, 3))  # 1 -> 2 leaves node
    assert Topology(["a", "a", "b"], rank=0).homogeneous is False


def test_topology_local_world_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2"):
        Topology(["group:0", "group:0", "group:0", "group:1"], rank=0, local_world_size=2)


def test_node_key_env():
    assert node_key({"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == "group:3"
    assert node_key({}).startswith("host:")
    with pytest.raises(ValueError, match="GROUP_RANK"):
        node_key({"GROUP_RANK": "-1"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        node_key({"LOCAL_WORLD_SIZE": "eight"})


# ------------------------------------------------------------------------------------------
# shard views (what hierarchical hands its outer hook)
# ------------------------------------------------------------------------------------------


class FakeBucket:
    def __init__(self, shapes):
        self.buf = torch.arange(sum(int(torch.Size(s).numel()) for s in shapes), dtype=torch.float)
        self.views, off = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            self.views.append(self.buf[off : off + n].view(s))
            off += n

    def buffer(self):
        return self.buf

    def gradients(self):
        return self.views

    def parameters(self):
        return []

    def index(self):
        return 0

    def is_last(self):
        return True


shapes_st = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 9)),
        st.tuples(st.integers(1, 7), st.integers(1, 7)),
        st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=6,
)


@given(shapes_st, st.integers(1, 5))
def test_shard_views_cover_each_shard_exactly_and_keep_rows(shapes, g):
    bucket = FakeBucket(shapes)
    n = bucket.buf.numel()
    shard_len = -(-n // g)
    padded = torch.cat([bucket.buf, torch.full((shard_len * g - n,), -1.0)])
    for k in range(g):
        shard = padded[k * shard_len : (k + 1) * shard_len].clone()
        sub = _buckets.shard_views(bucket, k * shard_len, shard)
        covered = torch.zeros(shard_len, dtype=torch.int)
        for v in sub.gradients():
            assert v.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
            start = (v.data_ptr() - shard.data_ptr()) // 4
            covered[start : start + v.numel()] += 1
            if v.dim() == 2:  # whole rows of one parameter: row starts are row multiples
                first = int(v[0, 0])
                owner = next(
                    g_
                    for g_ in bucket.views
                    if g_.reshape(-1)[0] <= first < g_.reshape(-1)[0] + g_.numel()
                )
                cols = owner.numel() // owner.shape[0]
                assert v.shape[1] == cols and (first - int(owner.reshape(-1)[0])) % cols == 0
        assert torch.equal(covered, torch.ones(shard_len, dtype=torch.int))


# ------------------------------------------------------------------------------------------
# pickling and import hygiene
# ------------------------------------------------------------------------------------------


def test_state_tree_pickles_without_groups():
    hook = comm.nan_check(comm.hierarchical(outer=comm.fp16_compress(scale=10)))
    hook.state.process_group = object()  # stands for a ProcessGroup, which cannot be pickled
    hook.state.traffic.add(_collectives.Link(None, (0, 1), inter=True), 123)
    loaded = pickle.loads(pickle.dumps(hook.state))
    assert loaded.process_group is None and loaded._ready is False
    assert loaded.inner.outer.scale == 10 and loaded.inner.outer.dtype == torch.float16
    assert loaded.bytes_sent()["inter"] == 123
    loaded.traffic.add(_collectives.Link(None, (0, 1), inter=False), 5)  # the lock came back
    assert loaded.bytes_sent()["intra"] == 5


def test_hook_passes_ddp_signature_checks():
    import inspect

    hook = comm.fp16_compress()
    assert list(inspect.signature(hook).parameters) == ["state", "bucket"]
    assert hook.__name__ == "aiak_cast" and hook.__qualname__ == "aiak_cast"


def test_import_is_lean():
    # comm is pure PyTorch: no sibling subpackage, no cupy/numba.
    code = (
        "import sys, aiak.comm; bad = [m for m in ('aiak.ops', 'aiak.optim', 'aiak.amp', "
        "'aiak.data', 'cupy', 'numba') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_encode_decode_compute_in_fp32(device: str, dtype: torch.dtype) -> None:
    scale = 1024.0  # a power of two: x*scale and w/scale are exact in fp32, so equality holds
    hook = comm_cast.cast_hook("t", dtype, None, scale)
    state = hook.state
    t = torch.randn(100_003, device=device) * 1e-6
    wire = hook.encode(state, t, t.numel() + 5)
    assert wire.dtype == dtype
    assert torch.equal(wire[: t.numel()], (t * scale).to(dtype)) and not wire[t.numel() :].any()
    # Decode in fp32: the smallest normal fp16 value / 1024 is ~6e-8, at the edge of fp16's
    # subnormals; an fp16 product would round it (and flush smaller ones), fp32 keeps it exact.
    tiny = torch.finfo(dtype).tiny
    wire[:3] = torch.tensor([tiny, 3 * tiny, -tiny], dtype=dtype)
    out = torch.full_like(t, float("nan"))
    hook.decode_(state, wire, out)
    assert torch.equal(out, wire[: t.numel()].double().div(scale).float())
    assert out[0].item() == tiny / scale != 0


@pytest.mark.parametrize("device", DEVICES)
def test_cast_scale_one_is_a_plain_cast(device: str) -> None:
    hook = comm_cast.cast_hook("t", torch.float16, None, 1.0)
    t = torch.randn(7, 5, device=device)
    wire = hook.encode(hook.state, t, 40)
    assert torch.equal(wire[:35], t.reshape(-1).half()) and not wire[35:].any()
    out = torch.empty_like(t)
    assert torch.equal(hook.decode_(hook.state, wire, out), t.half().float())


@pytest.mark.cuda
def test_cuda_cast_is_one_kernel_each_way() -> None:
    # The host cost per bucket is on DDP's critical path: one launch per direction.
    hook = comm_cast.cast_hook("t", torch.float16, None, 10.0)
    t = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(t)
    hook.decode_(hook.state, hook.encode(hook.state, t, t.numel()), out)  # warm, factor made
    torch.cuda.synchronize()
    wire = hook.encode(hook.state, t, t.numel())
    for fn in (
        lambda: hook.encode(hook.state, t, t.numel()),
        lambda: hook.decode_(hook.state, wire, out),
    ):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]


class _Bucket:
    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def buffer(self) -> torch.Tensor:
        return self._t


def test_offload_runs_in_order_and_forwards_results() -> None:
    from aiak.comm import _offload

    ran: list[int] = []

    def run(bucket: _Bucket) -> torch.futures.Future:
        ran.append(int(bucket.buffer()[0]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    futs = [_offload.submit(run, _Bucket(torch.tensor([float(i)]))) for i in range(50)]
    values = [f.wait() for f in futs]
    assert ran == list(range(50))  # FIFO: collectives keep DDP's order on every rank
    assert [int(v[0]) for v in values] == [2 * i for i in range(50)]


def test_offload_errors_reach_the_waiter_and_the_worker_survives() -> None:
    from aiak.comm import _offload

    def raises(bucket: _Bucket) -> torch.futures.Future:
        raise FloatingPointError("rank 0: bad gradients")

    def fails_later(bucket: _Bucket) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_exception(ValueError("peer died"))
        return fut

    def fine(bucket: _Bucket) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    t = torch.ones(3)
    bad, later, good = (_offload.submit(f, _Bucket(t)) for f in (raises, fails_later, fine))
    with pytest.raises(Exception, match=r"FloatingPointError.*rank 0: bad gradients"):
        bad.wait()
    with pytest.raises(Exception, match="peer died"):
        later.wait()
    assert torch.equal(good.wait(), t)


def test_register_rejects_a_non_bool_offload() -> None:
    ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)
    ddp.bucket_bytes_cap = 25 * 2**20
    with pytest.raises(TypeError, match="offload"):
        comm.register(ddp, comm.allreduce(), offload="yes")


@pytest.mark.parametrize(
    ("make", "syncs"),
    [
        (lambda: comm.allreduce(), False),
        (lambda: comm.fp16_compress(scale=10), False),
        (lambda: comm.powersgd(rank=2, start_iter=2), False),
        (lambda: comm.hierarchical(outer=comm.fp16_compress()), False),
        (lambda: comm.nan_check(), True),
        (lambda: comm.fp16_compress(comm.nan_check()), True),
        (lambda: comm.multi_stream(comm.nan_check(), streams=2), True),
        (lambda: comm.hierarchical(outer=comm.nan_check(comm.powersgd(start_iter=2))), True),
    ],
)
def test_trees_that_wait_on_the_host_are_the_ones_offloaded_by_default(make, syncs) -> None:
    # offload=None runs a tree on the worker thread (for CUDA buckets) exactly when some hook
    # in it waits for the GPU on the host; the rest are cheaper inline (2 x H200 measurements).
    assert make().syncing() is syncs


def test_a_cast_state_loaded_from_a_checkpoint_decodes() -> None:
    # Run-time fields come back as None after unpickling; the cast's cached 1/scale factor
    # must be rebuilt, not read from None (else a restored fp16 hook fails its first bucket).
    import pickle

    hook = comm_cast.cast_hook("t", torch.float16, None, 8.0)
    t = torch.randn(33)
    hook.decode_(hook.state, hook.encode(hook.state, t, 33), torch.empty(33))  # factor cached
    state = pickle.loads(pickle.dumps(hook.state))
    out = hook.decode_(state, hook.encode(state, t, 33), torch.empty(33))
    assert torch.equal(out, (t * 8).half().float() / 8)


def test_topology_needs_no_numpy() -> None:
    # torch does not require numpy; all_gather_object does: without numpy the topology must
    # still be found.
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import socket, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, "
        "world_size=1)\n"
        "from aiak.comm.topology import topology\n"
        "t = topology(); assert t.nodes == ((0,),), t\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize(
    ("outer", "mode", "serial"),
    [
        ("allreduce", "two-level", True),  # later stages launch from callbacks
        ("allreduce", "intra", False),  # one level: the stage's hook launches directly
        ("allreduce", "inter", False),
        ("allreduce", "flat", False),
        ("powersgd", "inter", True),  # PowerSGD itself launches Q from P's callback
        ("powersgd", "intra", False),  # one node: only the (plain) inner stage runs
    ],
)
def test_hierarchical_serialises_buckets_only_where_launches_are_deferred(outer, mode, serial):
    slow = comm.powersgd(rank=1) if outer == "powersgd" else comm.allreduce()
    hook = comm.hierarchical(outer=slow)
    hook.state._mode = mode  # what setup_tree decides from the topology
    assert hook.deferring(hook.state) is serial
    assert comm.nan_check(hook).deferring(comm.nan_check(hook).state) is serial


def test_env_dgc_settings_reach_the_hook():
    env = {
        "AIAK_DGC": "1",
        "AIAK_DGC_COMPRESS_RATIO": "0.01",
        "AIAK_DGC_SAMPLE_RATIO": "0.05",
        "AIAK_DGC_STRIDED_SAMPLE": "0",
        "AIAK_DGC_COMPRESS_UPPER_BOUND": "1.5",
        "AIAK_DGC_COMPRESS_LOWER_BOUND": "0.5",
        "AIAK_DGC_MAX_ADAPTATION_ITERS": "3",
        "AIAK_DGC_RESAMPLE": "0",
        "AIAK_DGC_FP16_VALUES": "1",
        "AIAK_DGC_INT32_INDICES": "1",
        "AIAK_DGC_WARMUP_EPOCHS": "2",
        "AIAK_DGC_WARMUP_COEFF": "0.5 0.1",
        "AIAK_DGC_MOMENTUM_MASKING": "0",
        "AIAK_CLIP_GRAD_FUNC": "norm",
        "AIAK_CLIP_GRAD_FUNC_PARAMS": "2.5",
        "PERSEUS_ALLREDUCE_NANCHECK": "1",
    }
    hook = comm.from_env(env)
    assert hook.__name__ == "aiak_nancheck"
    s = hook.state.inner
    assert isinstance(s, comm.DGCState) and s.awaits_optimizer
    assert (s.compress_ratio, s.sample_ratio, s.strided_sample) == (0.01, 0.05, False)
    assert (s.compress_upper_bound, s.compress_lower_bound) == (1.5, 0.5)
    assert (s.max_adaptation_iters, s.resample, s.fp16_values, s.int32_indices) == (
        3, False, True, True
    )  # fmt: skip
    assert (s.warmup_epochs, list(s.warmup_coeff), s.momentum_masking) == (2, [0.5, 0.1], False)
    assert (s.clip_grad_func, s.clip_grad_func_params) == ("norm", {"max_norm": 2.5})
    assert [s.ratio() for s.epoch in (0, 1, 2)] == [0.5, 0.1, 0.01]
    one = comm.from_env({"AIAK_DGC": "1", "AIAK_DGC_WARMUP_COEFF": "0.3"}).state
    assert one.warmup_coeff == 0.3 and one.compress_ratio == 0.001  # dgc()'s defaults


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AIAK_DGC_COMPRESS_RATIO": "0.01"}, "AIAK_DGC_COMPRESS_RATIO is a DGC setting"),
        ({"AIAK_CLIP_GRAD_FUNC": "norm"}, "AIAK_CLIP_GRAD_FUNC is a DGC setting"),
        ({"AIAK_DGC": "1", "AIAK_FP16_COMPRESSION": "1"}, "contradicts AIAK_FP16_COMPRESSION"),
        ({"AIAK_DGC": "1", "AIAK_HIERARCHICAL_ALLREDUCE": "1"}, "AIAK_HIERARCHICAL_ALLREDUCE"),
        ({"AIAK_DGC": "1", "PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4"}, "DOWNSAMPLE"),
        ({"AIAK_DGC": "1", "AIAK_CLIP_GRAD_FUNC": "norm"}, "go together"),
        (
            {"AIAK_DGC": "1", "AIAK_DGC_WARMUP_EPOCHS": "3", "AIAK_DGC_WARMUP_COEFF": "0.5 0.4"},
            "one per warm-up epoch",
        ),
    ],
)
def test_env_dgc_errors(env, message):
    with pytest.raises(ValueError, match=message):
        comm.parse_env(env)


def test_link_dgc_optimizer_takes_the_momentum_and_checks_the_optimizer():
    hook = comm.from_env({"AIAK_DGC": "1"})
    w = torch.nn.Parameter(torch.ones(3, 3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.7, nesterov=True)
    with pytest.raises(ValueError, match="would apply it twice"):
        comm.link_dgc_optimizer(hook, sgd)
    with pytest.raises(TypeError, match="SGD only"):
        comm.link_dgc_optimizer(hook, torch.optim.Adam([w]))
    two = torch.optim.SGD([{"params": [w], "momentum": 0.5}], lr=0.1, momentum=0.9)
    two.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(ValueError, match="differ in momentum"):
        comm.link_dgc_optimizer(hook, comm.DGCSGD.from_optimizer(two))
    assert hook.state.awaits_optimizer
    comm.link_dgc_optimizer(hook, comm.DGCSGD.from_optimizer(sgd))
    s = hook.state
    assert (s.momentum, s.nesterov, s.awaits_optimizer) == (0.7, True, False)
    with pytest.raises(ValueError, match="maximize"):
        comm.DGCSGD.from_optimizer(torch.optim.SGD([w], lr=0.1, maximize=True))
    with pytest.raises(ValueError, match="contains no DGC"):
        comm.link_dgc_optimizer(comm.allreduce(), sgd)
