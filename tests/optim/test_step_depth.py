"""How deep a fused optimizer step runs in Python: from ``step()`` to the launch, at most five
frames (docs/architecture.md draws the chain). The CUDA path runs on CPU tensors with the
driver call recorded (tests/_recorder.py), as on a GPU but for the launch itself."""

from __future__ import annotations

import sys

import pytest
import torch
from _recorder import Recorder

from aiak.ops import _capability, _cuda, _driver, _mta, _registry
from aiak.optim import LAMB, FusedAdamW, FusedSGD
from aiak.optim._common import FusedOptimizer


def _cpu_table(lists, device):
    return _mta.Table(torch.zeros(8, dtype=torch.int64), len(lists), len(lists[0]), 1, None, 0)


@pytest.fixture
def cuda_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    depths: list[int] = []

    def launch(config, handle, params, extra) -> int:
        frame, depth = sys._getframe(1), 0
        while frame is not None and frame.f_code is not FusedOptimizer.step.__code__:
            frame, depth = frame.f_back, depth + 1
        depths.append(depth if frame is not None else -1)
        return rec.ex(config, handle, params, extra)

    monkeypatch.setattr(_driver, "_ex", launch)
    monkeypatch.setattr(_cuda, "get_function", rec.get_function)
    monkeypatch.setattr(_cuda, "device_index", lambda: 0)
    monkeypatch.setattr(_cuda, "raw_stream", lambda device: 77)
    for k in _driver.DECLARED:
        monkeypatch.setattr(k, "_handles", {})
    monkeypatch.setattr(_registry.Op, "eager_kernel", lambda self, args, autograd=True: self.cuda)
    monkeypatch.setattr(_capability.Capability, "not_supported_reasons", lambda *a, **k: [])
    monkeypatch.setattr(_mta, "build", _cpu_table)
    monkeypatch.setattr(_mta.Table, "wait", lambda self: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _mta.clear_cache()
    rec.depths = depths  # type: ignore[attr-defined]
    yield rec
    _mta.clear_cache()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: FusedAdamW(ps, lr=1e-3),
        lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
        lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01),
    ],
)
def test_a_step_reaches_the_launch_in_five_frames(cuda_path_on_cpu: Recorder, make) -> None:
    ps = [torch.randn(s).requires_grad_() for s in ((4, 3), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = make(ps)
    opt.step()
    opt.step()  # the plans and bound steps are built: this is the steady state
    cuda_path_on_cpu.launches.clear()
    cuda_path_on_cpu.depths.clear()
    opt.step()
    updates = [
        d
        for d, launch in zip(cuda_path_on_cpu.depths, cuda_path_on_cpu.launches)
        if launch["name"] != "mt_l2norm"  # LAMB's norm on CPU goes through the op, not BoundNorm
    ]
    # step -> _step_group -> Bound.__call__ -> _launch -> Kernel.__call__ (the launch's caller)
    assert updates and all(d == 4 for d in updates), updates
