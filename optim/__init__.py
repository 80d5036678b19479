"""aiak.optim — fused optimizers.

Will hold fused Adam/AdamW/SGD, LAMB (apex FusedLAMB semantics) and LARS with one multi-tensor
launch per step on CUDA, a ``torch._foreach_*`` path with identical math on CPU, and
``fuse(optimizer)`` to swap a torch optimizer for its fused twin. Nothing is implemented yet.
"""
