"""DGC switched on without code change (``aiakrun --dgc``, ``AIAK_DGC=1``): comm/auto.py's part.

DGC keeps the gradient's momentum in its memory, so its optimizer must be SGD with momentum on
weight decay only (:class:`DGCSGD`). While active:

* ``torch.optim.SGD(...)`` returns ``DGCSGD.from_optimizer(torch.optim.SGD(...))``
  (:func:`build_sgd`, through the launcher's one swap of torch's optimizer classes, in
  ``aiak.launch._boot``; ``isinstance(opt, torch.optim.SGD)`` holds);
* each DDP model registers the environment's DGC hook, which refuses to exchange gradients
  until an SGD over the model's parameters is linked to it (its momentum is the SGD's), in
  whichever order the script builds the two;
* ``DistributedSampler.set_epoch(e)`` also sets DGC's epoch (the warm-up schedule's clock).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from ._base import CommHook
from .dgc import DGCSGD, _dgc_states, link_dgc_optimizer

_saved: dict[str, Any] = {}  # "set_epoch" -> the sampler's method, while active
# [DDP model (weak), its DGC hook, linked yet]: hook states have __slots__ and no weakref
_models: list[list[Any]] = []
_optimizers: list[weakref.ref] = []  # DGCSGDs built by build_sgd


def build_sgd(sgd: torch.optim.SGD) -> DGCSGD:
    """What ``torch.optim.SGD(...)`` builds while DGC is active: ``DGCSGD`` from torch's SGD
    (the launcher's one optimizer swap calls it), linked to its DDP model's DGC hook."""
    opt = DGCSGD.from_optimizer(sgd)
    _optimizers.append(weakref.ref(opt))
    _link()
    return opt


def activate() -> None:
    """``DistributedSampler.set_epoch`` also sets DGC's epoch. Idempotent."""
    if _saved:
        return
    set_epoch = DistributedSampler.set_epoch
    _saved["set_epoch"] = set_epoch

    def set_epoch_too(self: DistributedSampler, epoch: int) -> None:
        set_epoch(self, epoch)
        for _model, hook, _ in _alive():
            for state in _dgc_states(hook.state):
                state.set_epoch(epoch)

    DistributedSampler.set_epoch = set_epoch_too  # type: ignore[method-assign]


def deactivate() -> None:
    if not _saved:
        return
    DistributedSampler.set_epoch = _saved.pop("set_epoch")  # type: ignore[method-assign]
    _saved.clear()
    _models.clear()
    _optimizers.clear()


def on_ddp(ddp_model: torch.nn.Module, hook: CommHook | None) -> None:
    """Called for every DDP model activation built: remember its DGC hook until linked."""
    if hook is None or not _saved or not _dgc_states(hook.state):
        return
    _models.append([weakref.ref(ddp_model), hook, False])
    _link()


def _alive() -> list[list[Any]]:
    _models[:] = [e for e in _models if e[0]() is not None]
    return list(_models)


def _link() -> None:
    """Link every waiting hook to the optimizer that holds its model's parameters."""
    opts = [o for o in (r() for r in _optimizers) if o is not None]
    for entry in _alive():
        model, hook, linked = entry
        if linked:
            continue
        mine = {id(p) for p in model().parameters()}
        for opt in opts:
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                link_dgc_optimizer(hook, opt)
                entry[2] = True
                break
