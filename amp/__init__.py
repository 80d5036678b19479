"""aiak.amp — Apex-style O2 mixed precision that works with native torch AMP.

Will hold ``decorate(model, optimizer)`` (half model, fp32 BatchNorm, fp32 master weights in the
optimizer), O2 loss scaling that cooperates with ``torch.amp.GradScaler``, and checkpoints that
keep master weights. Nothing is implemented yet.
"""
