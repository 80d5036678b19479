"""decorate(): half model, fp32 BatchNorm, fp32 masters in the optimizer (apex O2).

The arguments are checked here, before anything changes; then each optimizer's half params are
swapped for fp32 masters (:func:`_make_masters`), the models are cast (``_model.py``) and each
optimizer gets its :class:`~aiak.amp._amp_state.AmpState` and hooks (``_hooks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from aiak.amp._amp_state import AmpState
from aiak.amp._hooks import hook_model_loads, hook_model_params, wrap_optimizer
from aiak.amp._model import HALF_DTYPES, cast_model, install_forward_casts
from aiak.amp._scaler import LossScalePolicy, check_int

__all__ = ["decorate"]

T = TypeVar("T")
# decorate keeps one loss scaler per loss from the start: a bound keeps a mistyped count from
# filling memory with scalers (apex's users pass 1 to 3)
MAX_LOSSES = 1024


def _as_list(obj: T | Sequence[T]) -> tuple[list[T], bool]:
    if isinstance(obj, (list, tuple)):
        return list(obj), True
    return [obj], False


def _check_models(models: list[nn.Module]) -> None:
    for model in models:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise RuntimeError(
                f"aiak.amp.decorate: the model is already wrapped in {type(model).__name__}; "
                "call aiak_amp_decorate before DDP (decorate the bare model, then wrap it)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"aiak.amp.decorate: models must be nn.Module objects, got {type(model).__name__}"
            )
        if getattr(model, "_aiak_amp_dtype", None) is not None:
            raise RuntimeError(
                "aiak.amp.decorate: this model is already decorated; decorate it once"
            )


def _check_optimizers(optimizers: list[torch.optim.Optimizer], models: list[nn.Module]) -> None:
    model_params = {id(p) for m in models for p in m.parameters()}
    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "aiak.amp.decorate: optimizers must be torch.optim.Optimizer objects, got "
                f"{type(opt).__name__}"
            )
        if getattr(opt, "_aiak_amp", None) is not None:
            raise RuntimeError(
                "aiak.amp.decorate: this optimizer is already decorated; decorate it once"
            )
        foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in model_params]
        if foreign:
            raise ValueError(
                f"aiak.amp.decorate: optimizer {k} holds {len(foreign)} tensors that are not "
                f"parameters of the model (first: shape {tuple(foreign[0].shape)}); the "
                "optimizer must hold the model's params: build it from model.parameters() "
                "before decorating"
            )
        for g in opt.param_groups:
            for p in g["params"]:
                if owner.setdefault(id(p), k) != k:
                    raise ValueError(
                        f"aiak.amp.decorate: optimizers {owner[id(p)]} and {k} both hold a "
                        f"parameter of shape {tuple(p.shape)}; each may be held by one only"
                    )


def _make_masters(
    optimizer: torch.optim.Optimizer, keep_fp32: set[int]
) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Swap the half params in ``param_groups`` (and their optimizer state) for fp32 masters.

    Called before the model is cast, so each master *is* the original fp32 storage: masters are
    exact, not the fp16-rounded copies apex made.
    """
    model_params, masters, fp32_params = [], [], []
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            if not p.is_floating_point():
                new_params.append(p)
                continue
            if id(p) in keep_fp32 and p.dtype == torch.float32:
                fp32_params.append(p)
                new_params.append(p)
                continue
            master = nn.Parameter(
                p.data if p.dtype == torch.float32 else p.detach().float(),
                requires_grad=p.requires_grad,
            )
            if p in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(p)
            model_params.append(p)
            masters.append(master)
            new_params.append(master)
        group["params"] = new_params
    return model_params, masters, fp32_params


def decorate(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    keep_batchnorm_fp32: bool = True,
    loss_scale: float | str | None = None,
    num_losses: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    dtype: torch.dtype = torch.float16,
    patch_torch_functions: bool = False,
) -> tuple[Any, Any]:
    """Apex O2: returns ``(models, optimizers)``, the same objects, changed in place.

    The models are cast to ``dtype`` (BatchNorm kept fp32 if ``keep_batchnorm_fp32``); their
    forward casts floating inputs to ``dtype`` and half outputs to fp32, and runs with autocast
    disabled (every device type it is on for, restored when forward returns or raises): the
    model is pure half, as in apex, even inside the user's ``with torch.autocast(...)``, whose
    fp32-list ops (layer_norm, softmax, ...) would otherwise run in fp32 inside it, slower and
    with fp32 activations saved. The loss, computed outside the model, keeps the user's
    autocast. ``patch_torch_functions=True`` (apex's name) leaves the user's autocast active
    inside the model instead, for models that need fp32 in those ops or use one with no half
    kernel (on CPU: ``torch.cdist``, ``avg_pool3d``, ``stft``, ...); the autocast dtype should
    then be ``dtype`` (else half ops mix fp16 and bf16). Each optimizer trains fp32 master
    copies instead of the half params and writes them back after every step.
    ``loss_scale`` None/"dynamic" or a number (static); ``num_losses`` (1 to 1024) scales for
    :func:`scale_loss`; a native GradScaler follows the same policy when :func:`aiak.amp.install`
    is active or when it is an :class:`aiak.amp.GradScaler`. Call before wrapping in DDP.
    """
    model_list, models_listed = _as_list(models)
    opt_list, opts_listed = _as_list(optimizers)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"aiak.amp.decorate: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}"
        )
    if dtype not in HALF_DTYPES:
        raise ValueError(f"aiak.amp.decorate: dtype must be float16 or bfloat16, got {dtype}")
    for name, flag in (
        ("keep_batchnorm_fp32", keep_batchnorm_fp32),
        ("patch_torch_functions", patch_torch_functions),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"aiak.amp.decorate: {name} must be a bool, got {type(flag).__name__}")
    check_int("aiak.amp.decorate", "num_losses", num_losses, 1, MAX_LOSSES)
    if not model_list:
        raise ValueError("aiak.amp.decorate: models must hold at least one model")
    if not opt_list:
        raise ValueError("aiak.amp.decorate: optimizers must hold at least one optimizer")
    policy = LossScalePolicy.o2(loss_scale, min_loss_scale, max_loss_scale)
    _check_models(model_list)
    _check_optimizers(opt_list, model_list)

    # What stays fp32 needs no master: the optimizer trains those params directly.
    keep_fp32 = {
        id(p)
        for model in model_list
        for module in model.modules()
        if keep_batchnorm_fp32 and isinstance(module, nn.modules.batchnorm._BatchNorm)
        for p in module.parameters(recurse=False)
    }
    split = [_make_masters(opt, keep_fp32) for opt in opt_list]
    for model in model_list:
        cast_model(model, dtype, keep_batchnorm_fp32)
        install_forward_casts(model, dtype, autocast_off=not patch_torch_functions)
        model._aiak_amp_dtype = dtype
    states = []
    for opt, (model_params, masters, fp32_params) in zip(opt_list, split):
        state = AmpState(opt, dtype, policy, num_losses, model_params, masters, fp32_params)
        wrap_optimizer(opt, state)
        hook_model_params(state)
        states.append(state)
    for model in model_list:
        hook_model_loads(model, states)
    return (
        model_list if models_listed else model_list[0],
        opt_list if opts_listed else opt_list[0],
    )
