"""Bad input to aiak.amp's public API: each call works as documented or raises
``ValueError``/``TypeError`` naming the argument; nothing else escapes (no AttributeError,
OverflowError, KeyError or RuntimeError from deep inside torch)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import aiak.amp as amp

# Values of the wrong type or range for any argument.
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["dynamic", "fp16", "float16"]),
    st.sampled_from([torch.int8, torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    st.just([1]),
    st.just(object()),
    st.just(torch.zeros(2)),
)

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def works_or_names(fn: Callable[[], Any], *names: str) -> Any:
    """``fn()``'s result, or None when it raised ValueError/TypeError naming one of ``names``."""
    try:
        return fn()
    except (ValueError, TypeError) as exc:
        assert any(n in str(exc) for n in names), (
            f"{type(exc).__name__}: {exc} names none of {names}"
        )
        return None


def model_and_opt(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = model.to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def decorated(**kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = model_and_opt()
    return amp.decorate(model, opt, **kwargs)


def check_forward(model: nn.Module) -> None:
    out = model(torch.randn(5, 4))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


# -- decorate ----------------------------------------------------------------------------------

DECORATE_ARGS = [
    "keep_batchnorm_fp32",
    "loss_scale",
    "num_losses",
    "min_loss_scale",
    "max_loss_scale",
    "dtype",
    "patch_torch_functions",
]


@pytest.mark.parametrize("name", DECORATE_ARGS)
@SETTINGS
@given(value=GARBAGE)
def test_decorate_argument_garbage(name: str, value: Any) -> None:
    result = works_or_names(lambda: decorated(**{name: value}), name)
    if result is not None:
        check_forward(result[0])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"loss_scale": -1}, "loss_scale"),
        ({"loss_scale": 0}, "loss_scale"),
        ({"loss_scale": math.nan}, "loss_scale"),
        ({"loss_scale": math.inf}, "loss_scale"),
        ({"loss_scale": "foo"}, "loss_scale"),
        ({"loss_scale": True}, "loss_scale"),
        ({"num_losses": 0}, "num_losses"),
        ({"num_losses": 1.5}, "num_losses"),
        ({"num_losses": True}, "num_losses"),
        ({"num_losses": 1025}, "num_losses"),  # one scaler per loss: a bound, not 2**31 of them
        ({"num_losses": 2**62}, "num_losses"),
        ({"min_loss_scale": 2.0**20, "max_loss_scale": 2.0**10}, "min_loss_scale"),
        ({"min_loss_scale": -1.0}, "min_loss_scale"),
        ({"min_loss_scale": "1"}, "min_loss_scale"),
        ({"max_loss_scale": math.inf}, "max_loss_scale"),
        ({"max_loss_scale": 0}, "max_loss_scale"),
        ({"dtype": torch.int8}, "dtype"),
        ({"dtype": torch.float64}, "dtype"),
        ({"dtype": "fp16"}, "dtype"),
        ({"keep_batchnorm_fp32": 1}, "keep_batchnorm_fp32"),
        ({"keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32"),
        ({"patch_torch_functions": 1}, "patch_torch_functions"),
    ],
)
def test_decorate_refuses_with_the_argument_named(kwargs: dict[str, Any], name: str) -> None:
    model, opt = model_and_opt()
    with pytest.raises((ValueError, TypeError), match=name):
        amp.decorate(model, opt, **kwargs)
    # Refused before anything changed: the model is still fp32 and can be decorated.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    amp.decorate(model, opt)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_scale": "dynamic"},
        {"loss_scale": None},
        {"loss_scale": 128},
        {"loss_scale": 2.0**30},  # static above max_loss_scale: the scale is what was asked
        {"min_loss_scale": 1.0, "max_loss_scale": 2.0**10},
        {"dtype": torch.bfloat16},
        {"num_losses": 3},
        {"keep_batchnorm_fp32": False},
    ],
)
def test_decorate_valid_arguments_work(kwargs: dict[str, Any]) -> None:
    model, _ = decorated(**kwargs)
    check_forward(model)


@pytest.mark.parametrize(
    ("models", "optimizers", "name"),
    [
        (5, None, "models"),
        ("model", None, "models"),
        ([], None, "models"),
        (None, 5, "optimizers"),
        (None, [], "optimizers"),
        (None, "sgd", "optimizers"),
        (None, torch.zeros(3), "optimizers"),
        (None, [None], "optimizers"),
    ],
)
def test_decorate_wrong_models_or_optimizers(models: Any, optimizers: Any, name: str) -> None:
    model, opt = model_and_opt()
    models = model if models is None else models
    optimizers = opt if optimizers is None else optimizers
    with pytest.raises((ValueError, TypeError), match=name):
        amp.decorate(models, optimizers)


def test_decorate_a_float64_model_keeps_batchnorm_fp32_and_runs() -> None:
    model, opt = model_and_opt(torch.float64)
    model, opt = amp.decorate(model, opt)
    bn = model[1]
    assert bn.weight.dtype == bn.bias.dtype == bn.running_mean.dtype == torch.float32
    assert model[0].weight.dtype == model[3].weight.dtype == torch.float16
    out = model(torch.randn(5, 4, dtype=torch.float64))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # and a step trains: the masters are fp32 and the half weights follow them
    scaler = amp.GradScaler("cpu", enabled=False)
    scaler.scale(out.square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


# -- LossScalePolicy and GradScaler ------------------------------------------------------------

POLICY_ARGS = [
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "static",
]


@pytest.mark.parametrize("name", POLICY_ARGS)
@SETTINGS
@given(value=GARBAGE)
def test_loss_scale_policy_garbage(name: str, value: Any) -> None:
    policy = works_or_names(lambda: amp.LossScalePolicy(**{name: value}), name)
    if policy is not None:  # accepted: a scaler with it works and stays in range
        scaler = amp.LossScaler(policy)
        s = scaler.scale(torch.device("cpu"))
        assert math.isfinite(float(s)) and float(s) > 0
        scaler.update(torch.ones(()))
        scaler.update(torch.zeros(()))
        assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0


def test_loss_scaler_needs_a_policy() -> None:
    with pytest.raises(TypeError, match="policy"):
        amp.LossScaler(2.0)


GRAD_SCALER_ARGS = ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"]


@pytest.mark.parametrize("name", GRAD_SCALER_ARGS)
@SETTINGS
@given(value=GARBAGE)
def test_grad_scaler_garbage(name: str, value: Any) -> None:
    works_or_names(lambda: amp.GradScaler("cpu", **{name: value}), name)


@SETTINGS
@given(value=GARBAGE)
def test_grad_scaler_device_garbage(value: Any) -> None:
    works_or_names(lambda: amp.GradScaler(value), "device")


# -- scale_loss --------------------------------------------------------------------------------


@SETTINGS
@given(loss_id=GARBAGE)
def test_scale_loss_loss_id(loss_id: Any) -> None:
    model, opt = decorated(num_losses=2)
    loss = model(torch.randn(5, 4)).square().mean()

    def run() -> None:
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()

    ok = isinstance(loss_id, int) and not isinstance(loss_id, bool) and 0 <= loss_id < 2
    if ok:
        run()
    else:
        with pytest.raises((ValueError, TypeError), match="loss_id"):
            run()
        # the refused block left nothing behind: a valid one still runs
        with amp.scale_loss(loss, opt, loss_id=0) as scaled:
            scaled.backward()


@pytest.mark.parametrize("loss", [1.0, None, "loss", [torch.ones(())]])
def test_scale_loss_loss_must_be_a_tensor(loss: Any) -> None:
    _, opt = decorated()
    with pytest.raises(TypeError, match="loss"), amp.scale_loss(loss, opt) as scaled:
        scaled.backward()


@pytest.mark.parametrize("optimizer", [None, 5, "sgd", nn.Linear(2, 2)])
def test_scale_loss_and_parameters_need_a_decorated_optimizer(optimizer: Any) -> None:
    with (
        pytest.raises((ValueError, TypeError), match="optimizer"),
        amp.scale_loss(torch.ones(()), optimizer),
    ):
        pass
    with pytest.raises((ValueError, TypeError), match="optimizer"):
        amp.parameters(optimizer)


def test_an_undecorated_optimizer_is_named() -> None:
    _, opt = model_and_opt()
    with pytest.raises(ValueError, match="optimizer"):
        amp.parameters(opt)


# -- state_dict / load_state_dict --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((5, "opt", None), "model"),
        (("model", 5, None), "optimizer"),
        (("model", "opt", 5), "scaler"),
        (("model", "opt", "scaler"), "scaler"),
    ],
)
def test_state_dict_wrong_objects(args: tuple, name: str) -> None:
    model, opt = decorated()
    objs = {"model": model, "opt": opt}
    call = [objs.get(a, a) if isinstance(a, str) and a in objs else a for a in args]
    with pytest.raises((ValueError, TypeError), match=name):
        amp.state_dict(*call)


def _checkpoint() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, opt = decorated()
    return model, opt, amp.state_dict(model, opt)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: 5,
        lambda c: [],
        lambda c: {},
        lambda c: {"model": c["model"]},
        lambda c: {**c, "model": 5},
        lambda c: {**c, "optimizer": "x"},
        lambda c: {**c, "optimizer": {**c["optimizer"], "aiak_amp": 5}},
        lambda c: {**c, "optimizer": {**c["optimizer"], "aiak_amp": {"version": 1}}},
        lambda c: {
            **c,
            "optimizer": {
                **c["optimizer"],
                "aiak_amp": {**c["optimizer"]["aiak_amp"], "masters": 3},
            },
        },
        lambda c: {
            **c,
            "optimizer": {
                **c["optimizer"],
                "aiak_amp": {**c["optimizer"]["aiak_amp"], "masters": [1, 2, 3, 4, 5, 6]},
            },
        },
        lambda c: {
            **c,
            "optimizer": {
                **c["optimizer"],
                "aiak_amp": {**c["optimizer"]["aiak_amp"], "loss_scalers": [{"scale": "x"}]},
            },
        },
        lambda c: {
            **c,
            "optimizer": {
                **c["optimizer"],
                "aiak_amp": {
                    **c["optimizer"]["aiak_amp"],
                    "loss_scalers": [{"scale": -1.0, "growth_tracker": 0}],
                },
            },
        },
        lambda c: {
            **c,
            "optimizer": {
                **c["optimizer"],
                "aiak_amp": {**c["optimizer"]["aiak_amp"], "skipped_steps": "many"},
            },
        },
        lambda c: {**c, "scaler": 5},
    ],
)
def test_load_state_dict_wrong_objects(mutate: Callable[[dict], Any]) -> None:
    model, opt, ckpt = _checkpoint()
    bad = mutate(ckpt)
    has_scaler = isinstance(bad, dict) and "scaler" in bad
    scaler = amp.GradScaler("cpu", enabled=False) if has_scaler else None
    with pytest.raises((ValueError, TypeError), match=r"checkpoint|aiak_amp|state_dict"):
        amp.load_state_dict(bad, model, opt, scaler)
    # a good checkpoint still loads afterwards
    amp.load_state_dict(ckpt, model, opt)
    check_forward(model)


@pytest.mark.parametrize("which", ["model", "optimizer", "scaler"])
def test_load_state_dict_wrong_targets(which: str) -> None:
    model, opt, ckpt = _checkpoint()
    args: dict[str, Any] = {"model": model, "optimizer": opt, "scaler": None}
    args[which] = 5
    with pytest.raises((ValueError, TypeError), match=which):
        amp.load_state_dict(ckpt, **args)
