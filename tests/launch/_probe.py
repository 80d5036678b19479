"""Prints, as JSON, what aiak's activation changed in this process (after importing torch)."""

import json
import sys

before = sorted(m for m in sys.modules if m == "torch" or m.startswith("aiak."))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ddp_init = torch.nn.parallel.DistributedDataParallel.__init__
print(
    json.dumps(
        {
            "before_torch": before,
            "aiak_modules": sorted(m for m in sys.modules if m.startswith("aiak.")),
            "lamb": hasattr(torch.optim, "LAMB"),
            "amp": hasattr(torch.cuda.amp, "aiak_amp_decorate"),
            "ddp_init": ddp_init.__code__.co_filename.rsplit("/", 2)[-2:],
            "adamw": torch.optim.AdamW.__module__ + "." + type(torch.optim.AdamW).__name__,
            "init_pg": dist.init_process_group.__module__,
        }
    )
)
