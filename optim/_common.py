"""What every aiak optimizer shares: the kernel switch, input checks, state steps, GradScaler
and amp copy-back plumbing, and a found_inf guard for the foreach path.

optim imports no sibling subpackage except ``aiak.ops``, guarded: when it is importable the CUDA
path calls ``torch.ops.aiak.fused_*``; otherwise (or on CPU) the same math runs with
``torch._foreach_*`` ops. Copying ``optim/`` alone into a project therefore works everywhere.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

# The dtypes the fused kernels take; float64 parameters always run the foreach path.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Tests set this to exercise the foreach path on CUDA (the path taken without aiak.ops).
FORCE_FOREACH = False

# Per-tensor reads as C-level callables: ``map(_grad, params)`` costs about half of the
# equivalent list comprehension, and every per-step pass over the params is one of these.
_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")
_layout = operator.attrgetter("layout")
_stride = torch.Tensor.stride


@functools.cache
def _ops_loaded() -> bool:
    try:
        import aiak.ops  # noqa: F401 - registers torch.ops.aiak.fused_*
    except ImportError:
        return False
    return True


def op(name: str) -> Any:
    """``aiak.ops.fused_optim.<name>`` (or ``aiak.ops.<name>``, as ``multi_tensor_l2norm``): the
    op's eager fast path (in eager CUDA the kernel is called without converting every tensor
    list through the dispatcher; otherwise the op itself), or ``torch.ops.aiak.<name>`` when
    neither is there. The dispatcher costs ~37 µs per Tensor[161] argument on a 2-core EPYC
    host (benchmarks/profile_optim_host.py), about twice that on the H100 machine's."""
    try:  # only called after _ops_loaded(); guarded all the same (optim/ may travel alone)
        import aiak.ops
    except ImportError:
        return getattr(torch.ops.aiak, name)
    module = getattr(aiak.ops, "fused_optim", None)
    found = getattr(module, name, None) or getattr(aiak.ops, name, None)
    return found or getattr(torch.ops.aiak, name)


def use_ops(device: torch.device) -> bool:
    """Whether to call ``torch.ops.aiak.fused_*`` for tensors on ``device``.

    Only on CUDA: there the op runs the kernel (or its own reference when CuPy is missing).
    On CPU the foreach path is the same math and faster than the op's per-tensor reference.
    """
    return device.type == "cuda" and not FORCE_FOREACH and _ops_loaded()


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_nonnegative(owner: str, **values: Any) -> None:
    for name, value in values.items():
        v = float(value)  # a tensor lr is read once here, at construction: no step-time sync
        if not v >= 0.0:  # also rejects NaN
            raise ValueError(f"{owner}: {name} must be >= 0, got {v}")


def check_betas(owner: str, betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"{owner}: betas[{i}] must be in [0, 1), got {float(b)}")


def check_params(owner: str, group: dict, index: int) -> None:
    """Floating-point params, all on one device (the kernels take one device per launch)."""
    devices = []
    for i, p in enumerate(group["params"]):
        if not p.is_floating_point():
            raise TypeError(
                f"{owner}: param_groups[{index}]['params'][{i}] has dtype {p.dtype}; "
                "only floating-point parameters can be optimized"
            )
        if p.device not in devices:
            devices.append(p.device)
    if len(devices) > 1:
        names = ", ".join(map(str, devices))
        raise ValueError(
            f"{owner}: param_groups[{index}] has params on several devices ({names}); "
            "put the params of each device in a group of their own"
        )


def check_dense_grads(
    owner: str, plan: Plan, grads: Sequence[torch.Tensor], which: Sequence[int] | None = None
) -> None:
    """Refuse sparse grads, naming the param's index in its group. ``grads``: those of
    ``plan.params``, or of ``plan.params[i] for i in which``."""
    if grads and set(map(_layout, grads)) != {torch.strided}:
        positions = [i for i, has in enumerate(plan.mask) if has]
        j = next(j for j, g in enumerate(grads) if g.layout != torch.strided)
        index = positions[j if which is None else which[j]]
        raise TypeError(
            f"{owner}: params[{index}] has a sparse grad; fused optimizers take dense grads only"
        )


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
        return 0.0, lr.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
    return float(lr), None


def amp_args(optimizer: Any, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """GradScaler's ``grad_scale`` and ``found_inf`` (set on optimizers with
    ``_step_supports_amp_scaling``) as fp32 one-element tensors on ``device``, or None."""
    out = []
    for name in ("grad_scale", "found_inf"):
        t = getattr(optimizer, name, None)
        if t is not None:
            t = t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
        out.append(t)
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
# The foreach path: fp32 arithmetic for half params, and the found_inf guard
# --------------------------------------------------------------------------------------------


def upcast(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 working copies of fp16/bf16 tensors (others as they are): the update is computed in
    fp32 and rounded once at the store, as the kernels do."""
    return [t.float() if t.dtype in HALF_DTYPES else t for t in ts]


def store(dst: Sequence[torch.Tensor], work: Sequence[torch.Tensor]) -> None:
    """Write working copies back where ``upcast`` made a copy."""
    pairs = [(d, w) for d, w in zip(dst, work) if d is not w]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [w for _, w in pairs])


def copy_back(copy_to: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    pairs = [(d, p) for d, p in zip(copy_to, params) if d.numel()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [p for _, p in pairs])


def unless_found_inf(
    found_inf: torch.Tensor | None, mutated: Iterable[torch.Tensor], update: Callable[[], None]
) -> None:
    """Run ``update`` unless ``found_inf != 0``, leaving ``mutated`` untouched when skipped.

    On CPU the flag is read directly (no device to synchronise). On a GPU without the aiak ops
    the update runs and each mutated tensor is then restored with torch.where: no host sync.
    """
    if found_inf is None:
        update()
        return
    if found_inf.device.type == "cpu":
        if found_inf.item() == 0:
            update()
        return
    mutated = list(mutated)
    saved = [t.clone() for t in mutated]
    update()
    skip = found_inf.reshape(()) != 0
    for t, old in zip(mutated, saved):
        t.copy_(torch.where(skip, old, t))


def coefficients(steps: Sequence[torch.Tensor], fn: Callable[[Any], Any]) -> list[Any]:
    """``fn(step)`` per tensor: Python floats when the steps live on the CPU (as torch's foreach
    optimizers compute them), 0-dim tensors otherwise (no host sync, like torch's capturable)."""
    if steps and steps[0].device.type == "cpu":
        return [fn(s.item()) for s in steps]
    return [fn(s) for s in steps]


# --------------------------------------------------------------------------------------------
# The per-group plan: the step's lists, built once
# --------------------------------------------------------------------------------------------
#
# Why: on CUDA a step is one launch per group, but building its arguments in Python walked the
# params several times per step (grads, ``self.state[p]`` for each state tensor — a dict lookup
# through ``Tensor.__hash__``, a Python function —, dtype and layout checks, copy-back targets).
# benchmarks/profile_optim_host.py (161 tensors, launches stubbed, CPU time on a 2-core EPYC):
# FusedAdamW 154 µs, FusedSGD 161 µs, LAMB 241 µs of Python per step before plans, 81 / 73 /
# 92 µs with them; the H100 machine's host is slower still (~2x). Everything but the grads is
# the same from step to step, so it is built once per group (``Plan``) and only
# re-validated per step with C-level identity checks (~1 µs per 25 tensors each).


class Plan:
    """One param group's step arguments (params with a grad, their state tensors, copy-back
    targets, layout facts), valid while what it was built from is unchanged.

    ``FusedOptimizer._plans`` rebuilds it when the group dict, its ``params`` list or any param
    in it, which params have a grad, the subclass's ``_plan_key`` (e.g. ``amsgrad``), any
    tensor in ``self.state`` (load_state_dict, a state entry set or deleted, ``state[p] =
    {}``) or the amp copy-back mapping changed, and after a step that marked it ``stale`` (SGD's
    first step, which creates momentum buffers). Only the grads are read per step.
    """

    __slots__ = (
        "copy_to",
        "device",
        "dtypes",
        "extra",
        "group",
        "group_params",
        "kernel_dtypes",
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
        self.stale = False
        ps = self.params
        self.device = ps[0].device if ps else None
        self.strides = tuple(map(_stride, ps))
        self.dtypes = tuple(map(_dtype, ps))
        self.kernel_dtypes = set(self.dtypes) <= set(KERNEL_DTYPES)
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
    plans. ~7 µs for 161 params x 3 entries on the 2-core EPYC host."""
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


def checked_grads(
    owner: str, plan: Plan, grads: list[torch.Tensor], kernel: bool
) -> list[torch.Tensor]:
    """``grads`` (of ``plan.params``) as the update takes them; sparse grads are refused.

    For the kernels, grads laid out like their params (the kernels walk param, grad and state
    memory in the same order): a grad with other strides or dtype is copied once into the
    param's layout. The usual case is two C-level maps compared with the plan's tuples; the
    stride map also refuses sparse layouts (compressed ones raise, COO ones report zeros).
    """
    if not kernel:
        check_dense_grads(owner, plan, grads)
        return grads
    try:
        strides = tuple(map(_stride, grads))
    except RuntimeError:  # sparse compressed layouts have no strides
        strides = None
    if strides == plan.strides and tuple(map(_dtype, grads)) == plan.dtypes:
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


def kernel_dtypes(tensors: Iterable[torch.Tensor]) -> bool:
    return set(map(_dtype, tensors)) <= set(KERNEL_DTYPES)


# --------------------------------------------------------------------------------------------
# The base class
# --------------------------------------------------------------------------------------------


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the aiak optimizers.

    - ``_step_supports_amp_scaling = True``: GradScaler hands ``grad_scale``/``found_inf`` to
      ``step()``, which unscales and skips on the device, like torch's fused optimizers.
    - amp copy-back: ``_aiak_supports_copy_back = True`` advertises that ``aiak.amp`` may set
      ``optimizer._aiak_copy_back = {master_param: model_param}``; ``step()`` then writes each
      updated fp32 master into its fp16/bf16 model param in the same kernel pass (on the
      foreach path, with one copy after the update).
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self._plans())
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
        return plan

    def _step(self, plans: list[tuple[Plan, list[torch.Tensor]]]) -> None:
        for plan, grads in plans:
            self._step_group(plan, grads)

    def _step_group(self, plan: Plan, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError
