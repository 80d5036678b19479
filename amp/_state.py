"""The O2 state machine: every stage, every event, every legal transition, in one table.

One machine per decorated optimizer. The happy path of one iteration::

    IDLE --backward--> GRADS_IN_MODEL --grads_copied--> MASTER_GRADS_READY --step--> STEPPED
         --copied_back--> COPIED_BACK --zero_grad--> IDLE

``scale_loss`` (apex style) unscales while it copies, so it lands in UNSCALED instead of
MASTER_GRADS_READY; with the native GradScaler the unscale happens inside torch, on the masters,
and the machine stays in MASTER_GRADS_READY until ``step``. A step that the loss scaler skips
(overflow) goes back to IDLE without touching the model.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ["TRANSITIONS", "AmpStateError", "Event", "Stage", "next_stage"]


class Stage(enum.Enum):
    IDLE = "idle"  # no gradient pending (fresh, or after zero_grad / a skipped step)
    GRADS_IN_MODEL = "grads in model"  # a backward is writing half grads into the model
    MASTER_GRADS_READY = "master grads ready"  # fp32 masters hold the (still scaled) grads
    UNSCALED = "unscaled"  # masters hold unscaled grads (scale_loss path)
    STEPPED = "stepped"  # the optimizer updated the masters
    COPIED_BACK = "masters copied back"  # the half model holds the new weights


class Event(enum.Enum):
    BACKWARD = "backward"
    GRADS_COPIED = "grads_copied"
    GRADS_UNSCALED = "grads_unscaled"
    STEP = "step"
    COPIED_BACK = "copied_back"
    SKIP = "skip"
    ZERO_GRAD = "zero_grad"


S, E = Stage, Event

# (stage, event) -> next stage. A pair that is not here is misuse and raises AmpStateError.
TRANSITIONS: Mapping[tuple[Stage, Event], Stage] = {
    # A backward may start from rest, accumulate onto ready grads (micro-batches), or follow a
    # step without zero_grad (torch accumulates then too; the masters mirror what torch holds).
    (S.IDLE, E.BACKWARD): S.GRADS_IN_MODEL,
    (S.MASTER_GRADS_READY, E.BACKWARD): S.GRADS_IN_MODEL,
    (S.COPIED_BACK, E.BACKWARD): S.GRADS_IN_MODEL,
    # scale_loss with several losses: each loss's backward follows the previous unscale.
    (S.UNSCALED, E.BACKWARD): S.GRADS_IN_MODEL,
    (S.GRADS_IN_MODEL, E.GRADS_COPIED): S.MASTER_GRADS_READY,
    (S.GRADS_IN_MODEL, E.GRADS_UNSCALED): S.UNSCALED,
    # A step without grads is legal in torch (it updates nothing); keep that.
    (S.IDLE, E.STEP): S.STEPPED,
    (S.MASTER_GRADS_READY, E.STEP): S.STEPPED,
    (S.UNSCALED, E.STEP): S.STEPPED,
    (S.COPIED_BACK, E.STEP): S.STEPPED,
    (S.STEPPED, E.COPIED_BACK): S.COPIED_BACK,
    (S.STEPPED, E.SKIP): S.IDLE,
    **{(stage, E.ZERO_GRAD): S.IDLE for stage in Stage},
}

# Why a missing pair is misuse, for the error message.
_HINTS: Mapping[tuple[Stage, Event], str] = {
    (S.GRADS_IN_MODEL, E.STEP): "the backward pass has not finished (did it raise?); "
    "call optimizer.zero_grad() and run the iteration again",
    (S.GRADS_IN_MODEL, E.BACKWARD): "a second backward started before the first one finished",
    (S.STEPPED, E.STEP): "the previous step never finished copying the masters back",
    (S.STEPPED, E.BACKWARD): "the previous step never finished copying the masters back",
    **{
        (stage, E.GRADS_UNSCALED): "no backward ran inside aiak.amp.scale_loss"
        for stage in Stage
        if stage is not S.GRADS_IN_MODEL
    },
}


class AmpStateError(RuntimeError):
    """An amp call that is illegal in the optimizer's current stage."""


def next_stage(stage: Stage, event: Event) -> Stage:
    """The stage after ``event``; raises :class:`AmpStateError` if ``event`` is illegal now."""
    try:
        return TRANSITIONS[(stage, event)]
    except KeyError:
        hint = _HINTS.get((stage, event), "see aiak.amp._state.TRANSITIONS for the legal order")
        raise AmpStateError(
            f"aiak.amp: {event.value!r} is not allowed in stage {stage.value!r}: {hint}"
        ) from None
