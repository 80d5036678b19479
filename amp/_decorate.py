"""decorate(): half model, fp32 BatchNorm, fp32 masters in the optimizer; the per-optimizer
:class:`AmpState` that moves gradients and weights between them. The model side (casting it,
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

Host cost per step (``benchmarks/profile_amp_host.py``): the GradScaler's ``.item()`` makes the
host finish everything after backward while the GPU waits, so every per-tensor Python statement
of the step path is exposed time (~1-2 µs each on the H100 machine's host, 161-170 tensors).
The copies therefore run from cached :class:`~aiak.amp._multi_tensor.Plan` objects, checked
against the live tensors with C-level passes (``map(operator.is_, ...)``) rather than rebuilt;
the masters keep their ``.grad`` buffers between steps instead of being cleared one by one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from aiak.amp import _multi_tensor
from aiak.amp._model import HALF_DTYPES, cast_model, install_forward_casts
from aiak.amp._scaler import LossScalePolicy, LossScaler
from aiak.amp._state import AmpStateError, Event, Stage, next_stage

__all__ = ["AmpState", "decorate", "parameters", "scale_loss", "state_of"]

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
_STATES: weakref.WeakValueDictionary[int, AmpState] = weakref.WeakValueDictionary()


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
        # _foreach_copy_: one C++ call. Measured on the H100 machine's host
        # (benchmarks/profile_amp_host.py --device cuda, 161 ResNet-50-shaped params, 55 of them
        # with masters): copy-back 86 µs through foreach vs 510 µs through the op on a set it
        # had cached; grad copy 323 vs 1237 µs when backward made new grads. The GPU work is
        # the same pass either way (~0.06 ms for ResNet-50). Set copy_backend = "aiak" to go
        # back to the op.
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

    # -- scale_loss (apex style) ---------------------------------------------------------------

    def begin_scaled_backward(self, loss_id: int) -> None:
        if self._active_loss is not None:
            raise AmpStateError("aiak.amp: scale_loss blocks cannot be nested")
        if self.stage not in (Stage.IDLE, Stage.UNSCALED, Stage.COPIED_BACK):
            raise AmpStateError(
                f"aiak.amp: scale_loss in stage {self.stage.value!r}: a plain backward already "
                "put scaled grads in the masters; use either scale_loss or GradScaler in one "
                "iteration, and call optimizer.zero_grad() first"
            )
        if not 0 <= loss_id < len(self.loss_scalers):
            raise ValueError(
                f"aiak.amp.scale_loss: loss_id {loss_id} out of range: decorate(num_losses="
                f"{len(self.loss_scalers)}) gives ids 0..{len(self.loss_scalers) - 1}"
            )
        if self.stage is Stage.COPIED_BACK:
            # A new iteration without zero_grad: the masters still hold the last step's grads
            # (after_step keeps them); losses of this iteration must not accumulate onto them.
            for m in self.masters:
                m.grad = None
        # fp32 params accumulate in .grad natively: set earlier losses' (unscaled) grads aside so
        # that this backward leaves only its own scaled grads there.
        self._stash = [p.grad for p in self.fp32_params]
        for p in self.fp32_params:
            p.grad = None
        self._active_loss = loss_id

    def abort_scaled_backward(self) -> None:
        """The block raised: give the fp32 params their earlier grads back."""
        for p, stashed in zip(self.fp32_params, self._stash):
            p.grad = stashed
        self._stash = []
        self._active_loss = None

    def end_scaled_backward(self, loss_id: int) -> None:
        self._active_loss = None
        self.transition(Event.GRADS_UNSCALED)
        scaler = self.loss_scalers[loss_id]
        half = [(p, m) for p, m in zip(self.model_params, self.masters) if p.grad is not None]
        fp32 = [p for p in self.fp32_params if p.grad is not None]
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
            self.backend,
        )
        olds, adds = [], []
        for (p, m), g in zip(half, new):
            p.grad = None  # consumed: the next loss's backward starts from zero
            if m.grad is None:
                m.grad = g
            else:
                olds.append(m.grad)
                adds.append(g)
        for p, stashed in zip(self.fp32_params, self._stash):
            if stashed is not None and p.grad is not None:
                olds.append(stashed)
                adds.append(p.grad)
                p.grad = stashed
            elif stashed is not None:
                p.grad = stashed
        self._stash = []
        if olds:
            torch._foreach_add_(olds, adds)
        scaler.update(found_inf)
        self._found_inf = found_inf if self._found_inf is None else self._found_inf + found_inf

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
        # overwrites them, and clearing 161 of them one by one here cost exposed host time.
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

    def check_loadable(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint that does not fit, before torch loads anything."""
        if state.get("version") != 1:
            raise ValueError(f"aiak.amp: unknown checkpoint version {state.get('version')!r}")
        masters = state["masters"]
        if len(masters) != len(self.masters) or len(state["loss_scalers"]) != len(
            self.loss_scalers
        ):
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
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        raise ValueError(
            f"this {type(optimizer).__name__} was not decorated: call "
            "aiak.amp.decorate(model, optimizer) first"
        )
    return state


def parameters(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The fp32 tensors the optimizer trains (masters, and fp32-kept params): clip these."""
    state_of(optimizer)  # here, not lazily at the first next()
    return (p for group in optimizer.param_groups for p in group["params"])


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
    state.begin_scaled_backward(loss_id)
    try:
        yield loss.float() * state.loss_scalers[loss_id].scale(loss.device)
    except BaseException:
        state.abort_scaled_backward()
        raise
    state.end_scaled_backward(loss_id)


# ----------------------------------------------------------------------------------------------
# decorate
# ----------------------------------------------------------------------------------------------

T = TypeVar("T")


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
            raise TypeError(f"aiak.amp.decorate: expected nn.Module, got {type(model).__name__}")
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
                f"aiak.amp.decorate: expected torch.optim.Optimizer, got {type(opt).__name__}"
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


def _wrap_optimizer(optimizer: torch.optim.Optimizer, state: AmpState) -> None:
    """Hooks for step and checkpoints; an instance ``zero_grad`` that also clears model grads.

    Hook closures hold the state weakly so the optimizer alone owns it.
    """
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
    _STATES[id(optimizer)] = state


def _hook_model_params(state: AmpState) -> None:
    ref = weakref.ref(state)

    def on_grad(param: torch.Tensor) -> None:
        # Runs once per param per backward: after the first, only this flag test.
        s = ref()
        if s is not None and not s._backward_queued:
            s.on_grad_accumulated()

    for p in state.model_params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_grad)


def _hook_model_loads(model: nn.Module, states: list[AmpState]) -> None:
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
    ``loss_scale`` None/"dynamic" or a number (static); ``num_losses`` scales for
    :func:`scale_loss`; a native GradScaler follows the same policy when :func:`aiak.amp.install`
    is active or when it is an :class:`aiak.amp.GradScaler`. Call before wrapping in DDP.
    """
    model_list, models_listed = _as_list(models)
    opt_list, opts_listed = _as_list(optimizers)
    if dtype not in HALF_DTYPES:
        raise ValueError(f"aiak.amp.decorate: dtype must be float16 or bfloat16, got {dtype}")
    if not isinstance(patch_torch_functions, bool):
        raise TypeError(
            "aiak.amp.decorate: patch_torch_functions must be a bool, got "
            f"{type(patch_torch_functions).__name__}"
        )
    if not (isinstance(num_losses, int) and num_losses >= 1):
        raise ValueError(f"aiak.amp.decorate: num_losses must be an int >= 1, got {num_losses!r}")
    if not model_list or not opt_list:
        raise ValueError("aiak.amp.decorate: needs at least one model and one optimizer")
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
        _wrap_optimizer(opt, state)
        _hook_model_params(state)
        states.append(state)
    for model in model_list:
        _hook_model_loads(model, states)
    return (
        model_list if models_listed else model_list[0],
        opt_list if opts_listed else opt_list[0],
    )
