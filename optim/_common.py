"""What every aiak optimizer shares: the kernel switch, input checks, state steps, GradScaler
and amp copy-back plumbing, and a found_inf guard for the foreach path.

optim imports no sibling subpackage except ``aiak.ops``, guarded: when it is importable the CUDA
path calls ``torch.ops.aiak.fused_*``; otherwise (or on CPU) the same math runs with
``torch._foreach_*`` ops. Copying ``optim/`` alone into a project therefore works everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

# The dtypes the fused kernels take; float64 parameters always run the foreach path.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Tests set this to exercise the foreach path on CUDA (the path taken without aiak.ops).
FORCE_FOREACH = False


@functools.cache
def _ops_loaded() -> bool:
    try:
        import aiak.ops  # noqa: F401 - registers torch.ops.aiak.fused_*
    except ImportError:
        return False
    return True


def op(name: str) -> Any:
    """``aiak.ops.fused_optim.<name>``: the op's eager fast path (in eager CUDA the kernel is
    called without converting every tensor list through the dispatcher; otherwise the op
    itself), or ``torch.ops.aiak.<name>`` when that module is not there."""
    import aiak.ops

    module = getattr(aiak.ops, "fused_optim", None)
    return getattr(module, name, None) or getattr(torch.ops.aiak, name)


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


def params_with_grad(owner: str, group: dict) -> list[torch.Tensor]:
    """The group's params that have a grad (the others are skipped, as torch does)."""
    params = group["params"]
    grads = [p.grad for p in params]
    out = [p for p, g in zip(params, grads) if g is not None]
    if len(out) < len(params):
        grads = [g for g in grads if g is not None]
    if grads and {g.layout for g in grads} != {torch.strided}:
        i = next(i for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse)
        raise TypeError(
            f"{owner}: params[{i}] has a sparse grad; fused optimizers take dense grads only"
        )
    return out


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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            self._upgrade_group(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        """Fill keys a state_dict from another optimizer (the torch twin) lacks."""
        for key, value in self.defaults.items():
            group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
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
        self._step(self._groups_with_grads())
        return loss

    def _groups_with_grads(self) -> list[tuple[dict, list[torch.Tensor]]]:
        out = []
        for group in self.param_groups:
            params = params_with_grad(type(self).__name__, group)
            if params:
                out.append((group, params))
        return out

    def _step(self, groups: list[tuple[dict, list[torch.Tensor]]]) -> None:
        for group, params in groups:
            self._step_group(group, params)

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError


def kernel_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Grads laid out like their params (the kernels walk param, grad and state memory in the
    same order). A grad with other strides or dtype is copied once into the param's layout."""
    grads = [p.grad for p in params]
    if tuple(map(torch.Tensor.stride, grads)) == tuple(map(torch.Tensor.stride, params)) and {
        (g.dtype is p.dtype) for g, p in zip(grads, params)
    } == {True}:
        return grads
    out = []
    for p, g in zip(params, grads):
        same = g.dtype == p.dtype and all(
            a == b for a, b, n in zip(g.stride(), p.stride(), p.shape) if n > 1
        )
        out.append(g if same else torch.empty_like(p).copy_(g))
    return out
