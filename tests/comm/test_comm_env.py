"""aiak.comm's environment variables: parsing, compositions, errors (single process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiak import comm

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
