"""Bad input to aiak.comm's public API: each call works as documented or raises
``ValueError``/``TypeError`` naming the argument or variable; nothing else escapes."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiak import comm
from aiak.comm import env as comm_env

# Values of the wrong type or range for any argument.
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just([1]),
    st.just(object()),
    st.just(torch.zeros(2)),
)


def works_or_names(fn: Callable[[], Any], *names: str) -> None:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        assert any(n in str(exc) for n in names), (
            f"{type(exc).__name__}: {exc} names none of {names}"
        )


FACTORIES: dict[str, tuple[Callable[..., Any], str]] = {
    "fp16_compress.scale": (lambda v: comm.fp16_compress(scale=v), "scale"),
    "bf16_compress.scale": (lambda v: comm.bf16_compress(scale=v), "scale"),
    "fp16_compress.inner": (lambda v: comm.fp16_compress(inner=v), "inner"),
    "powersgd.rank": (lambda v: comm.powersgd(rank=v), "rank"),
    "powersgd.start_iter": (lambda v: comm.powersgd(start_iter=v), "start_iter"),
    "powersgd.min_compression_rate": (
        lambda v: comm.powersgd(min_compression_rate=v),
        "min_compression_rate",
    ),
    "powersgd.error_feedback": (lambda v: comm.powersgd(error_feedback=v), "error_feedback"),
    "powersgd.warm_start": (lambda v: comm.powersgd(warm_start=v), "warm_start"),
    "powersgd.seed": (lambda v: comm.powersgd(seed=v), "seed"),
    "powersgd.eps": (lambda v: comm.powersgd(eps=v), "eps"),
    "hierarchical.inner": (lambda v: comm.hierarchical(inner=v), "inner"),
    "hierarchical.outer": (lambda v: comm.hierarchical(outer=v), "outer"),
    "hierarchical.fallback": (lambda v: comm.hierarchical(fallback=v), "fallback"),
    "multi_stream.streams": (lambda v: comm.multi_stream(streams=v), "streams"),
    "multi_stream.inner": (lambda v: comm.multi_stream(inner=v), "inner"),
    "nan_check.action": (lambda v: comm.nan_check(action=v), "action"),
    "nan_check.inner": (lambda v: comm.nan_check(inner=v), "inner"),
    "register.ddp_model": (lambda v: comm.register(v, comm.allreduce()), "ddp_model"),
    "accumulate.ddp_model": (lambda v: comm.accumulate(v, 2), "ddp_model"),
    "shutdown.timeout": (lambda v: comm.shutdown(timeout=v, destroy=False), "timeout"),
    "shutdown.models": (lambda v: comm.shutdown(v, destroy=False), "models"),
    "shutdown.destroy": (lambda v: comm.shutdown(destroy=v), "destroy"),
}


@pytest.mark.parametrize("where", sorted(FACTORIES))
@settings(max_examples=40, deadline=None)
@given(value=GARBAGE)
def test_factories_refuse_bad_values_by_name(where: str, value: Any) -> None:
    fn, name = FACTORIES[where]
    works_or_names(lambda: fn(value), name)


def test_exit_rank_checks_its_code_before_exiting() -> None:
    for code in (-1, 256, 1.5, "0", True):
        with pytest.raises(ValueError, match="code"):
            comm.exit_rank(code)


# Every variable aiak.comm reads, with what a valid value looks like.
VARIABLES = [
    "AIAK_HIERARCHICAL_ALLREDUCE",
    "AIAK_FP16_COMPRESSION",
    "AIAK_POWERSGD_COMPRESSION",
    "AIAK_MATRIX_APPROXIMATION_RANK",
    "AIAK_START_COMPRESS_ITER",
    "AIAK_COMM_LOG_STEPS",
    "AIAK_COALESCE_BUCKETS",
    "PERSEUS_ALLREDUCE_DTYPE",
    "PERSEUS_ALLREDUCE_MODE",
    "PERSEUS_ALLREDUCE_NANCHECK",
    "PERSEUS_ALLREDUCE_GRADIENT_SCALE",
    "PERSEUS_ALLREDUCE_STREAMS",
    "PERSEUS_ALLREDUCE_FUSION",
    "PERSEUS_ACCUMULATE_N_STEPS",
    "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
    "PERSEUS_GRADIENT_MOMENTUM",
    "PERSEUS_PERF_CHECK_N_STEPS",
    "AIAK_PERF_CHECK_MARGIN",
]

ENV_VALUES = st.one_of(
    # what an environment can hold: no NUL, no lone surrogates
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
    st.sampled_from(["0", "1", "2", "-1", "1e400", "inf", "nan", "0x10", "1.5", " 3 ", "yes"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@pytest.mark.parametrize("name", VARIABLES)
@settings(max_examples=60, deadline=None)
@given(raw=ENV_VALUES)
def test_every_variable_with_garbage_names_itself(name: str, raw: str) -> None:
    env = {name: raw}
    try:
        comm.from_env(env)
        comm.bucket_cap_mb(env)
    except (ValueError, TypeError) as exc:
        assert name in str(exc), f"{type(exc).__name__}: {exc}"


DGC_VARIABLES = [v for v in comm.env.DGC_VARIABLES if v != "AIAK_DGC"]


@pytest.mark.parametrize("name", DGC_VARIABLES)
@settings(max_examples=40, deadline=None)
@given(raw=ENV_VALUES)
def test_every_dgc_variable_with_garbage_names_itself(name: str, raw: str) -> None:
    try:
        comm.from_env({"AIAK_DGC": "1", name: raw})
    except (ValueError, TypeError) as exc:
        assert name in str(exc), f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("name", VARIABLES)
@pytest.mark.parametrize("value", [1, 1.5, b"1", ["1"]])
def test_non_string_variables_are_type_errors(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=name):
        comm_env.parse_env({name: value})


@settings(max_examples=60, deadline=None)
@given(raw=ENV_VALUES)
def test_gloo_timeout_with_garbage(raw: str) -> None:
    old = os.environ.get("GLOO_TIMEOUT_SECONDS")
    os.environ["GLOO_TIMEOUT_SECONDS"] = raw
    try:
        t = comm.gloo_timeout()
        assert 0 < t.total_seconds() <= 366 * 24 * 3600 and math.isfinite(t.total_seconds())
    except ValueError as exc:
        assert "GLOO_TIMEOUT_SECONDS" in str(exc)
    finally:
        if old is None:
            os.environ.pop("GLOO_TIMEOUT_SECONDS", None)
        else:
            os.environ["GLOO_TIMEOUT_SECONDS"] = old


@pytest.mark.parametrize("raw", ["inf", "1e20", "nan", "-inf"])
def test_gloo_timeout_overflow_is_a_value_error(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_TIMEOUT_SECONDS", raw)
    with pytest.raises(ValueError, match="GLOO_TIMEOUT_SECONDS"):
        comm.gloo_timeout()
