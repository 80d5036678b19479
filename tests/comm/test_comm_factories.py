"""Hook factories: argument checks, hierarchical's serialisation, linking DGC's optimizer."""

from __future__ import annotations

import pytest
import torch

from aiak import comm

# ------------------------------------------------------------------------------------------
# factory argument checks
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "exc", "arg"),
    [
        (lambda: comm.fp16_compress(scale=0), ValueError, "scale"),
        (lambda: comm.fp16_compress(scale="10"), TypeError, "scale"),
        (lambda: comm.bf16_compress(inner=lambda s, b: None), TypeError, "inner"),
        (lambda: comm.powersgd(rank=0), ValueError, "rank"),
        (lambda: comm.powersgd(rank=1.5), TypeError, "rank"),
        (lambda: comm.powersgd(start_iter=1), ValueError, "start_iter"),
        (lambda: comm.nan_check(action="ignore"), ValueError, "action"),
        (lambda: comm.multi_stream(streams=0), ValueError, "streams"),
        (lambda: comm.multi_stream(streams=2.0), TypeError, "streams"),
        (lambda: comm.hierarchical(inner=comm.powersgd()), TypeError, "inner"),
        (lambda: comm.hierarchical(outer=object()), TypeError, "outer"),
        (lambda: comm.hierarchical(fallback="maybe"), ValueError, "fallback"),
    ],
)
def test_factories_validate_arguments(make, exc, arg):
    with pytest.raises(exc, match=arg):
        make()


def test_powersgd_start_iter_may_be_small_without_memories():
    assert comm.powersgd(start_iter=0, error_feedback=False, warm_start=False).state.start_iter == 0


@pytest.mark.parametrize(
    ("outer", "mode", "serial"),
    [
        ("allreduce", "two-level", True),  # later stages launch from callbacks
        ("allreduce", "intra", False),  # one level: the stage's hook launches directly
        ("allreduce", "inter", False),
        ("allreduce", "flat", False),
        ("powersgd", "inter", True),  # PowerSGD itself launches Q from P's callback
        ("powersgd", "intra", False),  # one node: only the (plain) inner stage runs
    ],
)
def test_hierarchical_serialises_buckets_only_where_launches_are_deferred(outer, mode, serial):
    slow = comm.powersgd(rank=1) if outer == "powersgd" else comm.allreduce()
    hook = comm.hierarchical(outer=slow)
    hook.state._mode = mode  # what setup_tree decides from the topology
    assert hook.deferring(hook.state) is serial
    assert comm.nan_check(hook).deferring(comm.nan_check(hook).state) is serial


def test_link_dgc_optimizer_takes_the_momentum_and_checks_the_optimizer():
    hook = comm.from_env({"AIAK_DGC": "1"})
    w = torch.nn.Parameter(torch.ones(3, 3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.7, nesterov=True)
    with pytest.raises(ValueError, match="would apply it twice"):
        comm.link_dgc_optimizer(hook, sgd)
    with pytest.raises(TypeError, match="SGD only"):
        comm.link_dgc_optimizer(hook, torch.optim.Adam([w]))
    two = torch.optim.SGD([{"params": [w], "momentum": 0.5}], lr=0.1, momentum=0.9)
    two.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(ValueError, match="differ in momentum"):
        comm.link_dgc_optimizer(hook, comm.DGCSGD.from_optimizer(two))
    assert hook.state.awaits_optimizer
    comm.link_dgc_optimizer(hook, comm.DGCSGD.from_optimizer(sgd))
    s = hook.state
    assert (s.momentum, s.nesterov, s.awaits_optimizer) == (0.7, True, False)
    with pytest.raises(ValueError, match="maximize"):
        comm.DGCSGD.from_optimizer(torch.optim.SGD([w], lr=0.1, maximize=True))
    with pytest.raises(ValueError, match="contains no DGC"):
        comm.link_dgc_optimizer(comm.allreduce(), sgd)
