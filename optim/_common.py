"""What every aiak optimizer shares: input checks, state steps, GradScaler and amp copy-back
plumbing, and the per-group step plan.

The maths lives in ``aiak.ops`` (one op per optimizer family: ``fused_adam_``, ``fused_sgd_``,
``fused_lamb_``, ``multi_tensor_l2norm``): the CUDA kernel on CUDA, the op's PyTorch reference
elsewhere (CPU, float64 params, no CuPy). optim only gathers the op's arguments.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiak.optim._checks import (  # noqa: F401 - the optimizers' checks, used as C.<name>
    check_betas,
    check_dense_grads,
    check_flags,
    check_nonnegative,
    check_params,
    number,
)

# Per-tensor reads as C-level callables: ``map(_grad, params)`` costs about half of the
# equivalent list comprehension, and every per-step pass over the params is one of these.
_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")
_layout = operator.attrgetter("layout")
_stride = torch.Tensor.stride


# --------------------------------------------------------------------------------------------
# Scalars on the device: steps, lr, GradScaler's grad_scale / found_inf
# --------------------------------------------------------------------------------------------


def new_step(p: torch.Tensor) -> torch.Tensor:
    """A step counter as torch's fused optimizers keep it: float32, 0-dim, on the param's device.

    On the device, the kernels read and advance it without a host synchronisation.
    """
    return torch.zeros((), dtype=torch.float32, device=p.device)


def lr_args(lr: float | torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """(lr as a float, or the lr tensor on ``device`` as fp32): a tensor lr is never read on the
    host, so a CUDA graph captured with it follows later changes to it (capturable)."""
    if isinstance(lr, torch.Tensor):
        return 0.0, on_device(lr, device)
    return float(lr), None


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a one-element fp32 tensor on ``device`` (itself when it is one already: the ops
    read it through its address, and a copy per step would cost two torch calls)."""
    if t.dtype == torch.float32 and t.device == device:
        return t
    return t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)


def amp_args(optimizer: Any, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """GradScaler's ``grad_scale`` and ``found_inf`` (set on optimizers with
    ``_step_supports_amp_scaling``) as fp32 one-element tensors on ``device``, or None."""
    out = []
    for name in ("grad_scale", "found_inf"):
        t = getattr(optimizer, name, None)
        out.append(None if t is None else on_device(t, device))
    return tuple(out)


def copy_back_targets(optimizer: Any, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The amp copy-back list for ``params``: [] when none, else one tensor per param (an empty
    tensor where that param has no model copy). See ``FusedOptimizer``."""
    mapping = getattr(optimizer, "_aiak_copy_back", None)
    if not mapping:
        return []
    found = [mapping.get(p) for p in params]
    if all(t is None for t in found):
        return []
    device = params[0].device
    empty = torch.empty(0, device=device)
    return [empty if t is None else t for t in found]


# --------------------------------------------------------------------------------------------
# The per-group plan: the step's arguments, built once
# --------------------------------------------------------------------------------------------
#
# A step of a stable tensor set is the same call with new grads: everything else (params, state
# tensors, copy-back targets, the op's device table) is built once per group (``Plan``, holding
# an ``aiak.ops`` bound step), and each step re-validates it with a few C-level identity and
# address passes (research/profile_optim_host.py measures them).


class Plan:
    """One param group's step arguments (params with a grad, their state tensors, copy-back
    targets, layout facts), valid while what it was built from is unchanged.

    ``FusedOptimizer._plans`` rebuilds it when the group dict, its ``params`` list or any param
    in it, which params have a grad, the subclass's ``_plan_key`` (e.g. ``amsgrad``), any
    tensor in ``self.state`` (load_state_dict, a state entry set or deleted, ``state[p] =
    {}``) or the amp copy-back mapping changed, and after a step that marked it ``stale`` (SGD's
    first step, which creates momentum buffers). Only the grads are read per step; ``bound``
    (set by the optimizer) is the op with every list but the grads bound, which re-checks the
    grads' addresses per call (see ``aiak.ops._fused.Bound``).
    """

    __slots__ = (
        "bound",
        "copy_to",
        "device",
        "dtypes",
        "extra",
        "group",
        "group_params",
        "key",
        "lists",
        "mask",
        "params",
        "partial",
        "snapshot",
        "stale",
        "strides",
        "zero_strided",
    )

    def __init__(self, group: dict, mask: tuple[bool, ...], key: Any) -> None:
        self.group = group
        self.group_params = group["params"]
        self.snapshot = tuple(self.group_params)
        self.mask = mask
        self.partial = not all(mask)
        self.key = key
        self.params: list[torch.Tensor] = (
            list(itertools.compress(self.group_params, mask))
            if self.partial
            else list(self.group_params)
        )
        self.lists: dict[str, list[torch.Tensor]] = {}
        self.copy_to: list[torch.Tensor] = []
        self.extra: dict[str, Any] = {}  # subclasses' per-plan caches (workspaces, masks)
        self.bound: Any = None
        self.stale = False
        ps = self.params
        self.device = ps[0].device if ps else None
        self.strides = tuple(map(_stride, ps))
        self.dtypes = tuple(map(_dtype, ps))
        # A sparse COO grad reports all-zero strides: it passes the per-step stride comparison
        # only against a param whose strides are all zero too (0-dim), so those are checked.
        self.zero_strided = [i for i, st in enumerate(self.strides) if not any(st)]

    def valid_for(self, group: dict, mask: tuple[bool, ...], key: Any) -> bool:
        params = group["params"]
        return (
            not self.stale
            and self.group is group
            and self.group_params is params
            and self.mask == mask
            and self.key == key
            and len(params) == len(self.snapshot)
            and all(map(operator.is_, params, self.snapshot))
        )


def _state_tensors(state: dict) -> tuple | None:
    """Every value of every per-param state dict, in order: compared by identity per step, so a
    replaced state tensor, entry or dict (and load_state_dict's new ``state``) rebuilds the
    plans. One C-level pass over the state."""
    try:
        return tuple(itertools.chain.from_iterable(map(dict.values, state.values())))
    except TypeError:  # not dicts: nothing to compare, rebuild every step
        return None


def _copy_back_items(mapping: Any) -> tuple:
    if not mapping:
        return ()
    return (*mapping, *mapping.values())


def _same_objects(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(map(operator.is_, a, b))


def conform_grads(owner: str, plan: Plan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` (of ``plan.params``) as the ops take them: sparse grads are refused (naming the
    param), and a grad laid out unlike its param (other strides) is copied once into the
    param's layout (the kernels walk param, grad and state memory in the same order). The usual
    case is one C-level map compared with the plan's strides."""
    try:
        strides = tuple(map(_stride, grads))
    except RuntimeError:  # sparse compressed layouts have no strides
        strides = None
    if strides == plan.strides:
        if plan.zero_strided:
            zs = plan.zero_strided
            check_dense_grads(owner, plan, [grads[i] for i in zs], zs)
        return grads
    check_dense_grads(owner, plan, grads)
    out = []
    for p, g in zip(plan.params, grads):
        same = g.dtype == p.dtype and all(
            a == b for a, b, n in zip(g.stride(), p.stride(), p.shape) if n > 1
        )
        out.append(g if same else torch.empty_like(p).copy_(g))
    return out


def conformer(owner: str, plan: Plan) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda grads: conform_grads(owner, plan, grads)


# --------------------------------------------------------------------------------------------
# The base class
# --------------------------------------------------------------------------------------------


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the aiak optimizers.

    - ``_step_supports_amp_scaling = True``: GradScaler hands ``grad_scale``/``found_inf`` to
      ``step()``, which unscales and skips on the device, like torch's fused optimizers.
    - amp copy-back: ``_aiak_supports_copy_back = True`` advertises that ``aiak.amp`` may set
      ``optimizer._aiak_copy_back = {master_param: model_param}``; ``step()`` then writes each
      updated fp32 master into its fp16/bf16 model param in the same pass.
    - ``set_grad_none``: what ``zero_grad()`` does by default (apex's argument).
    - Per group, the step's lists are a cached :class:`Plan` (see there for when it is rebuilt).

    Subclasses implement ``_check_group``, ``_plan_lists`` (create missing state, return the
    state lists) and ``_step_group(plan, grads)``; ``_plan_key`` names group settings the lists
    depend on.
    """

    _aiak_supports_copy_back = True

    def __init__(self, params: Any, defaults: dict[str, Any], set_grad_none: bool = True) -> None:
        self._set_grad_none = bool(set_grad_none)
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    # Subclasses check their hyper-parameters here; `index` names the group in messages.
    def _check_group(self, group: dict, index: int) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        check_params(type(self).__name__, self.param_groups[index], index)
        self._check_group(self.param_groups[index], index)
        self._drop_plans()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._drop_plans()
        for group in self.param_groups:
            self._upgrade_group(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        """Fill keys a state_dict from another optimizer (the torch twin) lacks."""
        for key, value in self.defaults.items():
            group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._drop_plans()
        # torch's non-fused optimizers keep `step` on the CPU; ours live on the param's device.
        for p, st in self.state.items():
            step = st.get("step")
            if step is None:
                continue
            if not isinstance(step, torch.Tensor):
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
            elif step.dtype != torch.float32 or step.device != p.device:
                st["step"] = step.to(dtype=torch.float32, device=p.device).reshape(())

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self._set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every param group with grads: per group, ``_step_group`` calls the
        plan's bound op (see ``docs/architecture.md`` for the call chain to the launch)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            plans = self._plans()
            self._before_groups(plans)
            for plan, grads in plans:
                self._step_group(plan, grads)
        return loss

    # ---- plans ------------------------------------------------------------------------------

    def _drop_plans(self) -> None:
        # Not in __init__: unpickled or deep-copied optimizers (torch's __getstate__ keeps only
        # defaults, state and param_groups) come back without them, and rebuild.
        self.__dict__.pop("_aiak_plans", None)
        self.__dict__.pop("_aiak_plan_sig", None)

    def _plan_key(self, group: dict) -> Any:
        """Group settings the plan's lists depend on (compared with ``==`` per step)."""
        return None

    def _plan_lists(self, group: dict, params: list[torch.Tensor]) -> dict[str, list]:
        """Create missing state for ``params``; return the state lists the update takes."""
        raise NotImplementedError

    def _plans(self) -> list[tuple[Plan, list[torch.Tensor]]]:
        """(plan, grads of ``plan.params``) per group with any grad, in group order."""
        plans: list[Plan | None] = self.__dict__.get("_aiak_plans") or []
        mapping = getattr(self, "_aiak_copy_back", None)
        sig = self.__dict__.get("_aiak_plan_sig")
        if not (
            sig is not None
            and sig[0] is self.state
            and sig[2] is mapping
            and _same_objects(sig[1], _state_tensors(self.state))
            and _same_objects(sig[3], _copy_back_items(mapping))
        ):
            plans = []
        built = False
        out = []
        for i, group in enumerate(self.param_groups):
            grads = list(map(_grad, group["params"]))
            mask = tuple(map(operator.is_not, grads, itertools.repeat(None)))
            key = self._plan_key(group)
            plan = plans[i] if i < len(plans) else None
            if plan is None or not plan.valid_for(group, mask, key):
                plan = self._build_plan(group, grads, mask, key)
                if i < len(plans):  # plans has an entry for every earlier group
                    plans[i] = plan
                else:
                    plans.append(plan)
                built = True
            if not plan.params:
                continue
            out.append((plan, list(itertools.compress(grads, mask)) if plan.partial else grads))
        if built or len(plans) != len(self.param_groups):
            del plans[len(self.param_groups) :]
            self.__dict__["_aiak_plans"] = plans
            self.__dict__["_aiak_plan_sig"] = (
                self.state,
                _state_tensors(self.state),
                mapping,
                _copy_back_items(mapping),
            )
        return out

    def _build_plan(self, group: dict, grads: list, mask: tuple[bool, ...], key: Any) -> Plan:
        plan = Plan(group, mask, key)
        if plan.params:
            # Sparse grads are refused before any state is created (as torch does).
            check_dense_grads(type(self).__name__, plan, list(itertools.compress(grads, mask)))
            plan.lists = self._plan_lists(group, plan.params)
            plan.copy_to = copy_back_targets(self, plan.params)
            plan.bound = self._bind(plan)
        return plan

    def _bind(self, plan: Plan) -> Any:
        """The plan's bound op (``aiak.ops`` bind), or None when the step calls ops itself."""
        return None

    def _before_groups(self, plans: list[tuple[Plan, list[torch.Tensor]]]) -> None:
        """What a step computes over every group before the groups' updates (LAMB's global
        grad norm); nothing by default."""

    def _step_group(self, plan: Plan, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError
