"""aiak.comm — composable gradient-communication hooks for DistributedDataParallel.

Factories return hooks; wrappers take hooks; any combination composes::

    hook = comm.nan_check(comm.hierarchical(outer=comm.fp16_compress(scale=10)))
    comm.register(ddp_model, hook)          # or comm.register(ddp_model): from the env vars
    hook.state.bytes_sent()                 # {'intra': ..., 'inter': ..., ...} for the step

States are small picklable ``__slots__`` objects (process groups are dropped on pickle and set
up again on the first bucket). Pure PyTorch: no other aiak subpackage is imported.

Where things live: ``_base`` (the hook base and its state), one module per hook
(``allreduce``, ``cast``, ``nan_check``, ``multi_stream``, ``hierarchical``, ``powersgd``),
``_futures`` / ``_collectives`` / ``_buckets`` / ``_streams`` (the wire: future chaining,
collectives with byte accounting, bucket views, CUDA streams), ``env`` (the one reader of
environment variables), ``activate`` (hooks from the environment, registration on DDP),
``topology``, ``accumulate``, ``_offload`` (the worker thread), ``lifecycle`` (clean exits).
"""

from ._base import CommHook, HookState
from ._futures import CommError
from .accumulate import Accumulator, accumulate
from .activate import DGC_BUCKET_MB, bucket_cap_mb, ddp, from_env, register
from .allreduce import AllreduceState, allreduce
from .cast import CastState, bf16_compress, fp16_compress
from .dgc import DGCSGD, DGCState, check_dgc_optimizer, dgc, link_dgc_optimizer
from .downsample import DownsampleState, downsample
from .env import EnvConfig, gloo_timeout, parse_env
from .hierarchical import HierarchicalState, hierarchical
from .lifecycle import exit_rank, shutdown
from .multi_stream import MultiStreamState, multi_stream
from .nan_check import NanCheckState, nan_check
from .overlap import OverlapState, OverlapStep, overlap_step
from .powersgd import PowerSGDState, powersgd
from .topology import Topology, topology

__all__ = [
    "DGCSGD",
    "DGC_BUCKET_MB",
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
    "link_dgc_optimizer",
    "multi_stream",
    "nan_check",
    "overlap_step",
    "parse_env",
    "powersgd",
    "register",
    "shutdown",
    "topology",
]
