"""aiak.amp — Apex O2 mixed precision that keeps the native torch AMP loop working.

One line turns a native AMP loop into O2 (half model, fp32 BatchNorm, fp32 master weights)::

    model, optimizer = aiak.amp.decorate(model, optimizer)   # before DDP
    model = DDP(model); scaler = aiak.amp.GradScaler("cuda")  # or torch's, after install()
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast("cuda"):
            loss = loss_fn(model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(aiak.amp.parameters(optimizer), max_norm)
        scaler.step(optimizer); scaler.update()

:func:`install` adds AIAK-Training's spellings ``torch.cuda.amp.aiak_amp_decorate`` /
``aiak_amp_parameters`` and makes every ``GradScaler`` follow the O2 policy (x2 after 2000 clean
steps, /2 on overflow, within [min_loss_scale, max_loss_scale]) for decorated optimizers;
:func:`uninstall` undoes it. Without install(), use :class:`GradScaler`. Apex's own style,
``with scale_loss(loss, optimizer, loss_id=i) as s: s.backward()``, needs no GradScaler and
gives each of ``num_losses`` losses its own scale. ``dtype=torch.bfloat16`` needs no scaling.

What happens when (the stages are in ``aiak.amp._state.TRANSITIONS``): after each backward the
half grads are copied into the masters' ``.grad`` (one multi-tensor launch, after DDP's
allreduce); GradScaler unscales and checks the masters; ``step`` updates them; a step post-hook
copies them back into the half model (one launch). Checkpoints: ``optimizer.state_dict()``
carries the masters and the per-loss scales under ``"aiak_amp"``; :func:`state_dict` /
:func:`load_state_dict` bundle model, optimizer and GradScaler, and resume bit-identically.

Copy-back protocol with fused optimizers (``aiak.optim``; amp never imports it):

- an optimizer that can write the updated master into the half model param inside its own
  update kernel sets the class or instance attribute ``_aiak_supports_copy_back = True``;
- :func:`decorate` then sets ``optimizer._aiak_copy_back = {master: model_param, ...}``: a dict
  keyed by the fp32 master tensor object (the tensor in ``param_groups``), valued by the half
  ``nn.Parameter`` of the model (fp16 or bf16), for every param that has a master;
- in ``step()`` the optimizer writes ``model_param.copy_(master)`` (rounded to the model dtype)
  for every master it updates; amp then skips its own copy-back for that optimizer.

The plain copies (grads in, masters back) use ``torch._foreach_copy_``: on the H100 machine's
host it costs ~80 µs per copy against ~500 µs for a call of the aiak op (``AmpState.copy_backend``
switches). ``scale_loss``'s scaled copy uses ``torch.ops.aiak.multi_tensor_scale_`` when
``aiak.ops`` imports, and ``torch._foreach_*`` otherwise (``AmpState.backend``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aiak.amp._amp_state import AmpState, parameters, state_of
from aiak.amp._decorate import decorate
from aiak.amp._install import GradScaler, install, installed, uninstall
from aiak.amp._scale_loss import scale_loss
from aiak.amp._scaler import LossScalePolicy, LossScaler
from aiak.amp._state import TRANSITIONS, AmpStateError, Event, Stage

__all__ = [
    "TRANSITIONS",
    "AmpState",
    "AmpStateError",
    "Event",
    "GradScaler",
    "LossScalePolicy",
    "LossScaler",
    "Stage",
    "decorate",
    "install",
    "installed",
    "load_state_dict",
    "parameters",
    "scale_loss",
    "state_dict",
    "state_of",
    "uninstall",
]


def _check_targets(
    where: str, model: Any, optimizer: Any, scaler: torch.amp.GradScaler | None
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    state_of(optimizer)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"{where}: scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )


def state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """Everything a resume needs: model, optimizer (with fp32 masters and loss scales), scaler.

    Call it after ``scaler.update()`` (GradScaler's own rule). Tensors are references, as in
    torch's own state_dicts: ``torch.save`` the result, do not keep it while training on.
    """
    _check_targets("aiak.amp.state_dict", model, optimizer, scaler)
    out: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if scaler is not None:
        out["scaler"] = scaler.state_dict()
    return out


def load_state_dict(
    checkpoint: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Load :func:`state_dict`'s output into a decorated model/optimizer (and scaler).

    The model goes first and the optimizer second: loading the model re-derives the masters
    from its half weights, then the optimizer's exact fp32 masters overwrite them.
    """
    where = "aiak.amp.load_state_dict"
    _check_targets(where, model, optimizer, scaler)
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{where}: checkpoint must be a dict, got {type(checkpoint).__name__}")
    for key in ("model", "optimizer") + (("scaler",) if scaler is not None else ()):
        if key not in checkpoint:
            raise ValueError(f"{where}: the checkpoint has no {key!r} entry")
        if not isinstance(checkpoint[key], dict):
            raise TypeError(
                f"{where}: checkpoint[{key!r}] must be a state_dict (a dict), got "
                f"{type(checkpoint[key]).__name__}"
            )
    # The optimizer's amp entry is checked before the model changes.
    amp_entry = checkpoint["optimizer"].get("aiak_amp")
    if amp_entry is not None:
        state_of(optimizer).check_loadable(amp_entry)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(checkpoint["scaler"])
