"""Apex's per-loss scaling: ``with scale_loss(loss, optimizer, loss_id=i) as s: s.backward()``.

Each loss id has its own O2 scale (one :class:`~aiak.amp._scaler.LossScaler` per loss in the
optimizer's :class:`~aiak.amp._amp_state.AmpState`). The block's backward leaves scaled grads;
on exit they are moved into the fp32 masters, unscaled and checked in one launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from aiak.amp import _multi_tensor
from aiak.amp._amp_state import AmpState, state_of
from aiak.amp._state import AmpStateError, Event, Stage

__all__ = ["scale_loss"]


def begin_scaled_backward(state: AmpState, loss_id: object) -> None:
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise TypeError(
            f"aiak.amp.scale_loss: loss_id must be an int, got {type(loss_id).__name__}"
        )
    if not 0 <= loss_id < len(state.loss_scalers):
        raise ValueError(
            f"aiak.amp.scale_loss: loss_id {loss_id} out of range: decorate(num_losses="
            f"{len(state.loss_scalers)}) gives ids 0..{len(state.loss_scalers) - 1}"
        )
    if state._active_loss is not None:
        raise AmpStateError("aiak.amp: scale_loss blocks cannot be nested")
    if state.stage not in (Stage.IDLE, Stage.UNSCALED, Stage.COPIED_BACK):
        raise AmpStateError(
            f"aiak.amp: scale_loss in stage {state.stage.value!r}: a plain backward already "
            "put scaled grads in the masters; use either scale_loss or GradScaler in one "
            "iteration, and call optimizer.zero_grad() first"
        )
    if state.stage is Stage.COPIED_BACK:
        # A new iteration without zero_grad: the masters still hold the last step's grads
        # (after_step keeps them); losses of this iteration must not accumulate onto them.
        for m in state.masters:
            m.grad = None
    # fp32 params accumulate in .grad natively: set earlier losses' (unscaled) grads aside so
    # that this backward leaves only its own scaled grads there.
    state._stash = [p.grad for p in state.fp32_params]
    for p in state.fp32_params:
        p.grad = None
    state._active_loss = loss_id


def abort_scaled_backward(state: AmpState) -> None:
    """The block raised: give the fp32 params their earlier grads back."""
    for p, stashed in zip(state.fp32_params, state._stash):
        p.grad = stashed
    state._stash = []
    state._active_loss = None


def end_scaled_backward(state: AmpState, loss_id: int) -> None:
    state._active_loss = None
    state.transition(Event.GRADS_UNSCALED)
    scaler = state.loss_scalers[loss_id]
    half = [(p, m) for p, m in zip(state.model_params, state.masters) if p.grad is not None]
    fp32 = [p for p in state.fp32_params if p.grad is not None]
    if not half and not fp32:
        return
    device = (half[0][0] if half else fp32[0]).device
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    new = [torch.empty_like(m) for _, m in half]
    # One launch: half grads -> fresh fp32 buffers and fp32 grads in place, all unscaled.
    _multi_tensor.scale_(
        [p.grad for p, _ in half] + [p.grad for p in fp32],
        new + [p.grad for p in fp32],
        scaler.inv_scale(device),
        found_inf,
        state.backend,
    )
    olds, adds = [], []
    for (p, m), g in zip(half, new):
        p.grad = None  # consumed: the next loss's backward starts from zero
        if m.grad is None:
            m.grad = g
        else:
            olds.append(m.grad)
            adds.append(g)
    for p, stashed in zip(state.fp32_params, state._stash):
        if stashed is not None and p.grad is not None:
            olds.append(stashed)
            adds.append(p.grad)
            p.grad = stashed
        elif stashed is not None:
            p.grad = stashed
    state._stash = []
    if olds:
        torch._foreach_add_(olds, adds)
    scaler.update(found_inf)
    state._found_inf = found_inf if state._found_inf is None else state._found_inf + found_inf


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, loss_id: int = 0
) -> Iterator[torch.Tensor]:
    """Apex's ``with amp.scale_loss(loss, optimizer, loss_id=i) as scaled: scaled.backward()``.

    Each loss id has its own O2 scale. On exit the grads are moved into the fp32 masters,
    unscaled and checked in one launch, and that loss's scale is updated; ``optimizer.step()``
    is then skipped if any loss of the iteration overflowed. Needs no GradScaler.
    """
    state = state_of(optimizer)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"aiak.amp.scale_loss: loss must be a tensor, got {type(loss).__name__}")
    begin_scaled_backward(state, loss_id)
    try:
        yield loss.float() * state.loss_scalers[loss_id].scale(loss.device)
    except BaseException:
        abort_scaled_backward(state)
        raise
    end_scaled_backward(state, loss_id)
