"""Hand-written rank reports for aiak-advise's model tests (what the probe writes)."""

from __future__ import annotations

MS = 1e-3


def record(**phases: float) -> dict[str, float]:
    rec = dict.fromkeys(("data", "data_epoch_start", "forward", "backward", "comm"), 0.0)
    rec["optimizer"] = 0.0
    rec.update({k: v * MS for k, v in phases.items()})
    rec.setdefault("step", sum(rec[k] for k in ("data", "forward", "backward", "optimizer")))
    return rec


def report(records, rank=0, world=1, local=1, ops=None, work=None, **facts):
    base = {
        "optimizer": {
            "type": "AdamW",
            "module": "torch.optim.adamw",
            "groups": 1,
            "tensors": 4,
            "parameters": 1_050_112,
            "dtypes": ["float32"],
            "foreach": None,
            "fused": None,
            "shapes": [[1024, 512], [1024], [512, 1024], [512]],
            "device": "cpu",
        },
        "loaders": [],
        "ddp": [],
    }
    base.update(facts)
    return {
        "rank": rank,
        "world": world,
        "local_world": local,
        "backend": "gloo" if world > 1 else None,
        "cuda": False,
        "complete": True,
        "warmup": 5,
        "steps_seen": 5 + len(records),
        "records": records,
        "ops": ops or {"forward": 10, "backward": 20, "optimizer": 40},
        "work": work or {"forward": [10**6, 10**8], "backward": [2 * 10**6, 2 * 10**8]},
        "rates": {"elem_s": 1e-9, "mac_s": 5e-11},
        "op_cost_s": 5e-6,
        "facts": base,
    }
