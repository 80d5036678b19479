"""The hooks that drive an :class:`~aiak.amp._amp_state.AmpState`: the optimizer's step and
checkpoint hooks and its ``zero_grad``, the model params' post-accumulate-grad hooks (the end of
each backward), and the model's load hook (masters re-derived from loaded half weights).

Hook closures hold the state weakly, so the optimizer alone owns it.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
from torch import nn

from aiak.amp._amp_state import STATES, AmpState

__all__ = ["hook_model_loads", "hook_model_params", "wrap_optimizer"]


def wrap_optimizer(optimizer: torch.optim.Optimizer, state: AmpState) -> None:
    """Hooks for step and checkpoints; an instance ``zero_grad`` that also clears model grads."""
    ref = weakref.ref(state)

    def before_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        ref().before_step()

    def after_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        ref().after_step()

    def add_amp_state(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        sd["aiak_amp"] = ref().state_dict()
        return sd

    def pop_amp_state(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        sd = dict(sd)
        pending = sd.pop("aiak_amp", None)
        if pending is not None:
            ref().check_loadable(pending)
        ref()._pending_load = pending
        return sd

    def load_amp_state(opt: torch.optim.Optimizer) -> None:
        s = ref()
        pending, s._pending_load = s._pending_load, None
        if pending is not None:
            s.load_state_dict(pending)

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    optimizer.register_state_dict_post_hook(add_amp_state)
    optimizer.register_load_state_dict_pre_hook(pop_amp_state)
    optimizer.register_load_state_dict_post_hook(load_amp_state)

    original_zero_grad = optimizer.zero_grad  # bound: keeps any instance-level override

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original_zero_grad(set_to_none)
        ref().zero_model_grads(set_to_none)

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer._aiak_amp = state
    if state.fused_copy_back:
        optimizer._aiak_copy_back = dict(zip(state.masters, state.model_params))
    STATES[id(optimizer)] = state


def hook_model_params(state: AmpState) -> None:
    ref = weakref.ref(state)

    def on_grad(param: torch.Tensor) -> None:
        # Runs once per param per backward: after the first, only this flag test.
        s = ref()
        if s is not None and not s._backward_queued:
            s.on_grad_accumulated()

    for p in state.model_params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_grad)


def hook_model_loads(model: nn.Module, states: list[AmpState]) -> None:
    refs = [weakref.ref(s) for s in states]

    def refresh_masters(module: nn.Module, incompatible_keys: Any) -> None:
        # Loading weights into the half model makes the masters stale; re-derive them so the
        # next step does not write the old weights back. Loading the optimizer's state_dict
        # afterwards restores the exact fp32 masters.
        for r in refs:
            s = r()
            if s is None:
                continue
            with torch.no_grad():
                for p, m in zip(s.model_params, s.masters):
                    m.copy_(p)

    model.register_load_state_dict_post_hook(refresh_masters)
