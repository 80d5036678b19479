"""aiak.optim — fused optimizers: Adam/AdamW/SGD, LAMB and FusedLAMB, LARS.

Drop-ins for torch.optim with the same math and state layout (a state_dict moves between
``FusedAdamW`` and ``torch.optim.AdamW`` both ways). On CUDA each step is one kernel launch per
device over all the tensors (``torch.ops.aiak.fused_*`` from ``aiak.ops``), with GradScaler's
unscale/skip and the learning rate read on the device: no host synchronisation. Elsewhere (CPU,
float64 params, no CuPy) the op runs its PyTorch reference, the same math in
``torch._foreach_*`` ops.

    from aiak.optim import FusedAdamW, LAMB, fuse
    opt = FusedAdamW(model.parameters(), lr=1e-3)      # or: opt = fuse(torch.optim.AdamW(...))
"""

from aiak.optim.adam import FusedAdam, FusedAdamW
from aiak.optim.convert import from_env, fuse, install, uninstall
from aiak.optim.lamb import LAMB, FusedLAMB
from aiak.optim.lars import LARS
from aiak.optim.sgd import FusedSGD

__all__ = [
    "LAMB",
    "LARS",
    "FusedAdam",
    "FusedAdamW",
    "FusedLAMB",
    "FusedSGD",
    "from_env",
    "fuse",
    "install",
    "uninstall",
]
