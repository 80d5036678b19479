"""The per-optimizer :class:`AmpState` that moves gradients and weights between the half model
and the fp32 masters. ``_decorate.py`` builds it, ``_hooks.py`` connects it to autograd and the
optimizer, ``_scale_loss.py`` runs apex's per-loss scaling on it; the model side (casting it,
its forward hooks, autocast off inside it) is ``_model.py``.

Where each O2 duty happens, and why there:

- half grads -> fp32 masters: at the end of every backward, from an autograd final callback
  queued by a post-accumulate-grad hook. The callback re-queues itself once so that it runs
  after the callbacks queued *during* backward, i.e. after DDP has averaged the grads. The
  masters mirror what torch accumulated in the model (they are overwritten, not added to), so
  micro-batch accumulation and ``DDP.no_sync()`` work exactly as they do without amp.
  GradScaler.unscale_/step then find fp32 grads in ``param_groups``, as they require.
- fp32 masters -> half model: in a step post-hook, one multi-tensor launch, unless the
  optimizer does it inside its own kernel (the ``_aiak_copy_back`` protocol, see ``__init__``).
- ``zero_grad`` also clears the half model grads: a step skipped by GradScaler must not leave
  its inf grads behind for the next backward to accumulate onto.

Host cost per step (``research/profile_amp_host.py``): the GradScaler's ``.item()`` makes the
host finish everything after backward while the GPU waits, so every per-tensor Python statement
of the step path is exposed time (~1-2 µs each on the H100 machine's host, 161-170 tensors).
The copies therefore run from cached :class:`~aiak.amp._multi_tensor.Plan` objects, checked
against the live tensors with C-level passes (``map(operator.is_, ...)``) rather than rebuilt;
the masters keep their ``.grad`` buffers between steps instead of being cleared one by one.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from aiak.amp import _multi_tensor
from aiak.amp._scaler import LossScalePolicy, LossScaler
from aiak.amp._state import Event, Stage, next_stage

__all__ = ["AmpState", "parameters", "state_of"]

_ENGINE = torch.autograd.Variable._execution_engine
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclasses.dataclass
class _GradCopy:
    """How one backward's half grads reach the masters, kept while the grads stay the same.

    ``grads`` are the model grads the plan was made for (None where a param had none), by
    identity; ``masters``/``bufs`` the masters that receive a grad and their fp32 buffers;
    ``idle`` the masters whose model param had no grad (their ``.grad`` must be None).
    """

    grads: list[torch.Tensor | None]
    nones: int
    plan: _multi_tensor.Plan | None
    masters: list[nn.Parameter]
    bufs: list[torch.Tensor]
    idle: list[nn.Parameter]


# id(optimizer) -> its AmpState, for GradScaler.update, which only sees optimizer ids. Values are
# weak: a state lives exactly as long as its optimizer (the one strong reference to it).
STATES: weakref.WeakValueDictionary[int, AmpState] = weakref.WeakValueDictionary()


class AmpState:
    """What amp knows about one decorated optimizer: its tensors, its policy, its stage."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dtype: torch.dtype,
        policy: LossScalePolicy,
        num_losses: int,
        model_params: list[nn.Parameter],
        masters: list[nn.Parameter],
        fp32_params: list[nn.Parameter],
    ) -> None:
        # configuration
        self.dtype = dtype
        self.policy = policy
        # The scaled copy of scale_loss (copy + unscale + inf check in one pass) uses the aiak
        # op when it is there. The plain copies (grads in, masters back) use torch's
        # _foreach_copy_ (``copy_backend``): one C++ call, which costs the host less than a
        # call of the op (H100 host, 161 ResNet-50-shaped params, 55 with masters: copy-back
        # 86 vs 510 µs, grad copy 323 vs 1237 µs when backward makes new grads;
        # research/profile_amp_host.py). The GPU work is the same pass either way.
        self.backend = _multi_tensor.default_backend()
        self.copy_backend = "foreach"
        self.loss_scalers = [LossScaler(policy) for _ in range(num_losses)]
        # tensors: model_params[i] (half) is trained through masters[i] (fp32); fp32_params are
        # model params kept fp32 (BatchNorm) that the optimizer trains directly.
        self.model_params = model_params
        self.masters = masters
        self.fp32_params = fp32_params
        self.fused_copy_back = bool(getattr(optimizer, "_aiak_supports_copy_back", False))
        # the machine
        self.stage = Stage.IDLE
        self.skipped_steps = 0
        self._optimizer = weakref.ref(optimizer)
        self._backward_queued = False
        self._active_loss: int | None = None
        self._stash: list[torch.Tensor | None] = []
        self._found_inf: torch.Tensor | None = None
        self._skip = False
        self._step_depth = 0
        self._grad_bufs: list[torch.Tensor | None] = [None] * len(masters)
        self._grad_copy: _GradCopy | None = None
        self._copy_back: _multi_tensor.Plan | None = None
        self._sync_checked = False
        self._pending_load: dict[str, Any] | None = None

    def transition(self, event: Event) -> None:
        self.stage = next_stage(self.stage, event)

    # -- backward ------------------------------------------------------------------------------

    def on_grad_accumulated(self) -> None:
        if self._backward_queued:
            return
        self.transition(Event.BACKWARD)
        self._backward_queued = True
        _ENGINE.queue_callback(self._requeue_after_backward)

    def _requeue_after_backward(self) -> None:
        # Runs first among the final callbacks; DDP queued its own (the allreduce finalisation)
        # during backward, so going to the back of the queue puts us after it.
        _ENGINE.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._backward_queued = False
        if self._active_loss is not None:
            return  # scale_loss moves and unscales the grads when its block exits
        if not self._sync_checked:
            self._check_masters_in_sync()
        gc = self._grad_copy_for(list(map(_GRAD, self.model_params)))
        # zero_grad(set_to_none=True) (every step by default) and a skipped scale_loss step
        # clear the masters' .grad: point them at their buffers again. One C-level pass when
        # nothing changed (zero_grad(set_to_none=False), or accumulation).
        if not all(map(operator.is_, map(_GRAD, gc.masters), gc.bufs)):
            for master, buf in zip(gc.masters, gc.bufs):
                master.grad = buf
        for master in gc.idle:
            master.grad = None
        if gc.plan is not None:
            with torch.no_grad():
                gc.plan.copy_()
        self.transition(Event.GRADS_COPIED)

    def _grad_copy_for(self, grads: list[torch.Tensor | None]) -> _GradCopy:
        """The grad copy for this backward's model grads: the cached one while they are the
        same tensors (zero_grad(set_to_none=False), accumulation); the cached one re-pointed at
        new grads when they are new tensors of the same params (set_to_none=True); else a new
        one, walking the params in Python once."""
        gc = self._grad_copy
        if gc is not None and (gc.plan is None or gc.plan.backend == self.copy_backend):
            if all(map(operator.is_, grads, gc.grads)) and (gc.plan is None or gc.plan.valid()):
                return gc
            nones = sum(map(operator.is_, grads, itertools.repeat(None)))
            if nones == 0 and gc.nones == 0 and gc.plan is not None:
                plan = gc.plan.with_src(grads)
                if plan is not None:
                    gc.grads, gc.plan = grads, plan
                    return gc
        srcs, masters, bufs, idle = [], [], [], []
        for i, (grad, master) in enumerate(zip(grads, self.masters)):
            if grad is None:
                idle.append(master)
                continue
            buf = self._grad_bufs[i]
            if buf is None:
                # empty_like keeps the master's layout (channels_last too), which is the grad's.
                buf = self._grad_bufs[i] = torch.empty_like(master)
            srcs.append(grad)
            masters.append(master)
            bufs.append(buf)
        plan = _multi_tensor.Plan(srcs, bufs, self.copy_backend) if srcs else None
        gc = self._grad_copy = _GradCopy(grads, len(idle), plan, masters, bufs, idle)
        return gc

    def _check_masters_in_sync(self) -> None:
        """Once, at the first backward: was the half model changed behind amp's back (DDP's
        broadcast from rank 0 is the usual case)? Then re-derive the masters from it."""
        self._sync_checked = True
        with torch.no_grad():
            stale = [
                i
                for i, (p, m) in enumerate(zip(self.model_params, self.masters))
                if not torch.equal(p, m.to(p.dtype))
            ]
            for i in stale:
                self.masters[i].copy_(self.model_params[i])
        if stale:
            warnings.warn(
                f"aiak.amp: {len(stale)} half parameters changed after decorate (DDP broadcast "
                "from rank 0, or a manual edit); their fp32 masters were re-derived from the "
                "half values. Build the same model on every rank, or load the checkpoint after "
                "decorate, to keep the masters exact.",
                stacklevel=2,
            )

    # -- step and zero_grad --------------------------------------------------------------------

    def before_step(self) -> None:
        # torch runs the step hooks once per *patched class* step: an optimizer subclass whose
        # step() calls super().step() runs them twice, nested. Only the outer pair counts.
        self._step_depth += 1
        if self._step_depth > 1:
            return
        self.transition(Event.STEP)
        if self._found_inf is not None:
            # apex skips the step on overflow; like GradScaler this costs one host sync.
            overflow = bool(self._found_inf.item())
            self._found_inf = None
            if overflow:
                self._skip = True
                # torch optimizers skip params without grads: with none, the step is a no-op.
                for p in (*self.masters, *self.fp32_params):
                    p.grad = None

    def after_step(self) -> None:
        self._step_depth -= 1
        if self._step_depth > 0:
            return
        if self._skip:
            self._skip = False
            self.skipped_steps += 1
            self.transition(Event.SKIP)
            return
        if not self.fused_copy_back:
            self.copy_masters_to_model()
        # The masters keep their .grad (their fp32 buffers, held anyway): the next backward
        # overwrites them, and clearing 161 of them one by one here costs exposed host time.
        self.transition(Event.COPIED_BACK)

    def zero_model_grads(self, set_to_none: bool) -> None:
        if set_to_none:
            for p in self.model_params:
                p.grad = None
        else:
            grads = [g for g in map(_GRAD, self.model_params) if g is not None]
            if any(map(_REQUIRES_GRAD, grads)):  # a create_graph backward: as torch does
                for g in grads:
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
            if grads:
                torch._foreach_zero_(grads)  # one call, not one zero_() per grad
        self._found_inf = None
        self._backward_queued = False  # a backward that raised never ran its callback
        self._step_depth = 0  # nor did a step that raised run its post-hook
        self.transition(Event.ZERO_GRAD)

    def copy_masters_to_model(self) -> None:
        plan = self._copy_back
        if plan is None or plan.backend != self.copy_backend or not plan.valid():
            # The params themselves, not p.detach() per step (a new tensor each: ~1-2 µs apiece
            # on the H100 host); under no_grad the copy may write them. Aliases the plan makes
            # detach.
            plan = self._copy_back = _multi_tensor.Plan(
                self.masters, self.model_params, self.copy_backend
            )
        with torch.no_grad():
            plan.copy_()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "dtype": str(self.dtype).removeprefix("torch."),
            "masters": list(self.masters),  # references, as torch's optimizer state_dict gives
            "loss_scalers": [s.state_dict() for s in self.loss_scalers],
            "skipped_steps": self.skipped_steps,
        }

    def check_loadable(self, state: Any) -> None:
        """Refuse a checkpoint that does not fit, before torch loads anything."""
        where = "aiak.amp: the optimizer state_dict's 'aiak_amp' entry"
        if not isinstance(state, dict):
            raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
        if state.get("version") != 1:
            raise ValueError(f"{where}: unknown checkpoint version {state.get('version')!r}")
        missing = {"masters", "loss_scalers", "skipped_steps"} - state.keys()
        if missing:
            raise ValueError(f"{where} lacks {sorted(missing)}")
        masters, scalers = state["masters"], state["loss_scalers"]
        for name, seq in (("masters", masters), ("loss_scalers", scalers)):
            if not isinstance(seq, (list, tuple)):
                raise TypeError(f"{where}: {name} must be a list, got {type(seq).__name__}")
        if not all(isinstance(m, torch.Tensor) for m in masters):
            raise TypeError(f"{where}: masters must be tensors")
        for s in scalers:
            LossScaler.check_state_dict(s, where)
        steps = state["skipped_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{where}: skipped_steps must be an int >= 0, got {steps!r}")
        if len(masters) != len(self.masters) or len(scalers) != len(self.loss_scalers):
            raise ValueError(
                f"aiak.amp: the checkpoint has {len(masters)} masters and "
                f"{len(state['loss_scalers'])} loss scalers; this optimizer has "
                f"{len(self.masters)} and {len(self.loss_scalers)}"
            )
        for mine, saved in zip(self.masters, masters):
            if mine.shape != saved.shape:
                raise ValueError(
                    f"aiak.amp: a checkpoint master has shape {tuple(saved.shape)}, "
                    f"the optimizer's has {tuple(mine.shape)}"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_loadable(state)
        masters = state["masters"]
        with torch.no_grad():
            for mine, saved in zip(self.masters, masters):
                mine.copy_(saved)
        self.copy_masters_to_model()
        for scaler, saved in zip(self.loss_scalers, state["loss_scalers"]):
            scaler.load_state_dict(saved)
        self.skipped_steps = int(state["skipped_steps"])
        # The masters are what the checkpoint says; no need to re-check them against the model.
        self._sync_checked = True


def state_of(optimizer: torch.optim.Optimizer) -> AmpState:
    """The :class:`AmpState` of a decorated optimizer (TypeError/ValueError otherwise)."""
    state = getattr(optimizer, "_aiak_amp", None)
    if not isinstance(state, AmpState):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "aiak.amp: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        raise ValueError(
            f"aiak.amp: the optimizer ({type(optimizer).__name__}) was not decorated: call "
            "aiak.amp.decorate(model, optimizer) first"
        )
    return state


def parameters(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The fp32 tensors the optimizer trains (masters, and fp32-kept params): clip these."""
    state_of(optimizer)  # here, not lazily at the first next()
    return (p for group in optimizer.param_groups for p in group["params"])
