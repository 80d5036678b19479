"""Pickling (checkpoints) and import hygiene of hooks and states."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch

from aiak import comm
from aiak.comm import _collectives
from aiak.comm import cast as comm_cast

# ------------------------------------------------------------------------------------------
# pickling and import hygiene
# ------------------------------------------------------------------------------------------


def test_state_tree_pickles_without_groups():
    hook = comm.nan_check(comm.hierarchical(outer=comm.fp16_compress(scale=10)))
    hook.state.process_group = object()  # stands for a ProcessGroup, which cannot be pickled
    hook.state.traffic.add(_collectives.Link(None, (0, 1), inter=True), 123)
    loaded = pickle.loads(pickle.dumps(hook.state))
    assert loaded.process_group is None and loaded._ready is False
    assert loaded.inner.outer.scale == 10 and loaded.inner.outer.dtype == torch.float16
    assert loaded.bytes_sent()["inter"] == 123
    loaded.traffic.add(_collectives.Link(None, (0, 1), inter=False), 5)  # the lock came back
    assert loaded.bytes_sent()["intra"] == 5


def test_hook_passes_ddp_signature_checks():
    import inspect

    hook = comm.fp16_compress()
    assert list(inspect.signature(hook).parameters) == ["state", "bucket"]
    assert hook.__name__ == "aiak_cast" and hook.__qualname__ == "aiak_cast"


def test_import_is_lean():
    # comm is pure PyTorch: no sibling subpackage, no cupy/numba.
    code = (
        "import sys, aiak.comm; bad = [m for m in ('aiak.ops', 'aiak.optim', 'aiak.amp', "
        "'aiak.data', 'cupy', 'numba') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cast_state_loaded_from_a_checkpoint_decodes() -> None:
    # Run-time fields come back as None after unpickling; the cast's cached 1/scale factor
    # must be rebuilt, not read from None (else a restored fp16 hook fails its first bucket).
    import pickle

    hook = comm_cast.cast_hook("t", torch.float16, None, 8.0)
    t = torch.randn(33)
    hook.decode_(hook.state, hook.encode(hook.state, t, 33), torch.empty(33))  # factor cached
    state = pickle.loads(pickle.dumps(hook.state))
    out = hook.decode_(state, hook.encode(state, t, 33), torch.empty(33))
    assert torch.equal(out, (t * 8).half().float() / 8)
