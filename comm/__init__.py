"""aiak.comm — composable gradient-communication hooks for DistributedDataParallel.

Factories return hooks; wrappers take hooks; any combination composes::

    hook = comm.nan_check(comm.hierarchical(outer=comm.fp16_compress(scale=10)))
    comm.register(ddp_model, hook)          # or comm.register(ddp_model): from the env vars
    hook.state.bytes_sent()                 # {'intra': ..., 'inter': ..., ...} for the step

States are small picklable ``__slots__`` objects (process groups are dropped on pickle and set
up again on the first bucket). Pure PyTorch: no other aiak subpackage is imported.
"""

from ._wire import CommError, gloo_timeout
from .accumulate import Accumulator, accumulate
from .dgc import DGCSGD, DGCState, check_dgc_optimizer, dgc
from .downsample import DownsampleState, downsample
from .env import EnvConfig, bucket_cap_mb, ddp, from_env, parse_env, register
from .hierarchical import HierarchicalState, hierarchical
from .hooks import (
    AllreduceState,
    CastState,
    CommHook,
    HookState,
    MultiStreamState,
    NanCheckState,
    allreduce,
    bf16_compress,
    fp16_compress,
    multi_stream,
    nan_check,
)
from .lifecycle import exit_rank, shutdown
from .overlap import OverlapState, OverlapStep, overlap_step
from .powersgd import PowerSGDState, powersgd
from .topology import Topology, topology

__all__ = [
    "DGCSGD",
    "Accumulator",
    "AllreduceState",
    "CastState",
    "CommError",
    "CommHook",
    "DGCState",
    "DownsampleState",
    "EnvConfig",
    "HierarchicalState",
    "HookState",
    "MultiStreamState",
    "NanCheckState",
    "OverlapState",
    "OverlapStep",
    "PowerSGDState",
    "Topology",
    "accumulate",
    "allreduce",
    "bf16_compress",
    "bucket_cap_mb",
    "check_dgc_optimizer",
    "ddp",
    "dgc",
    "downsample",
    "exit_rank",
    "fp16_compress",
    "from_env",
    "gloo_timeout",
    "hierarchical",
    "multi_stream",
    "nan_check",
    "overlap_step",
    "parse_env",
    "powersgd",
    "register",
    "shutdown",
    "topology",
]
