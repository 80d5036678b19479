"""aiak.comm — gradient-communication hooks for DistributedDataParallel.

Will hold composable DDP communication-hook factories (allreduce, fp16/bf16 compression with a
gradient scale, PowerSGD, hierarchical two-level allreduce, NaN checks, multi-stream buckets),
local gradient accumulation, and activation from the AIAK_*/PERSEUS_* environment variables.
Nothing is implemented yet.
"""
