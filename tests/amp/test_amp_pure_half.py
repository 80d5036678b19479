"""decorate() runs the model purely in half: autocast is off inside it, back on after it.

On CPU, autocast's fp32 list is not CUDA's: layer_norm and softmax stay bf16 under CPU autocast,
while prod (used below), cdist, mse_loss, nll_loss, avg_pool3d, ... are computed in fp32. So
the probe for "autocast is active inside the model" here is ``prod``, and LayerNorm/softmax are
checked to be half in both modes.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _amp_helpers import conv_net, image_data, seed_step
from torch import nn
from torch.nn import functional as F

import aiak.amp as amp

BF16 = torch.bfloat16


class Prod(nn.Module):
    """An op on CPU autocast's fp32 list: fp32 out under autocast, half out without."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.prod(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.softmax = nn.Softmax(-1)
        self.prod = Prod()
        self.head = nn.Linear(8, 3)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        h = self.prod(self.softmax(self.ln(self.lin(x))))
        return self.head(h.to(self.head.weight.dtype))


def _probe(model: Block) -> dict[str, tuple[torch.dtype, bool]]:
    """name -> (output dtype, CPU autocast on) of each inner module, filled by its forward."""
    seen: dict[str, tuple[torch.dtype, bool]] = {}
    for name in ("ln", "softmax", "prod"):

        def hook(module: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
            seen[name] = (out.dtype, torch.is_autocast_enabled("cpu"))

        getattr(model, name).register_forward_hook(hook)
    return seen


def _decorated(**kwargs) -> Block:
    model = Block()
    amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16, **kwargs)
    return model


def test_model_is_pure_half_inside_the_users_autocast() -> None:
    model = _decorated()
    seen = _probe(model)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with torch.autocast("cpu", dtype=BF16):
        out = model(x)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
        loss = F.cross_entropy(out, y)
    assert seen == {"ln": (BF16, False), "softmax": (BF16, False), "prod": (BF16, False)}
    assert out.dtype == torch.float32
    assert loss.dtype == torch.float32  # the user's autocast still ran the loss (fp32 list)
    loss.backward()
    assert model.lin.weight.grad.dtype == BF16


def test_patch_torch_functions_keeps_the_users_autocast_inside() -> None:
    model = _decorated(patch_torch_functions=True)
    seen = _probe(model)
    with torch.autocast("cpu", dtype=BF16):
        out = model(torch.randn(4, 8))
        assert torch.is_autocast_enabled("cpu")
    # prod is on CPU autocast's fp32 list; layer_norm/softmax are only on CUDA's.
    assert seen == {"ln": (BF16, True), "softmax": (BF16, True), "prod": (torch.float32, True)}
    assert out.dtype == torch.float32


def test_outside_autocast_nothing_changes() -> None:
    model = _decorated()
    seen = _probe(model)
    out = model(torch.randn(4, 8))
    assert seen == {"ln": (BF16, False), "softmax": (BF16, False), "prod": (BF16, False)}
    assert out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_is_restored_when_forward_raises() -> None:
    model = _decorated()
    seen = _probe(model)
    with torch.autocast("cpu", dtype=BF16):
        model.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(4, 8))
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
        model.fail = False
        model(torch.randn(4, 8))  # and the next call is pure half again
        assert torch.is_autocast_enabled("cpu")
    assert seen["prod"] == (BF16, False)
    assert not torch.is_autocast_enabled("cpu")


def test_nested_calls_restore_in_order() -> None:
    """A model that calls itself (and catches a failing inner call): autocast stays off for the
    rest of the outer forward and comes back only when the outer call returns."""
    states = []

    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
            if depth == 0:
                raise ValueError("innermost")
            if depth > 1:
                x = self(x, depth - 1).to(x.dtype)
            else:
                with pytest.raises(ValueError, match="innermost"):
                    self(x, 0)
            states.append((depth, torch.is_autocast_enabled("cpu"), x.dtype))
            return self.lin(x)

    model = Recursive()
    amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    with torch.autocast("cpu", dtype=BF16):
        out = model(torch.randn(2, 4), 3)
        assert torch.is_autocast_enabled("cpu")
    assert states == [(1, False, BF16), (2, False, BF16), (3, False, BF16)]
    assert out.dtype == torch.float32


def test_every_device_type_autocast_is_on_for_is_turned_off() -> None:
    """CUDA's autocast flag (set directly: this runs on CPU-only machines too) is turned off
    inside and restored, along with CPU's."""
    model = _decorated()
    inside = []
    model.ln.register_forward_hook(
        lambda *_: inside.append(
            (torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
        )
    )
    torch.set_autocast_enabled("cuda", True)
    try:
        with torch.autocast("cpu", dtype=BF16):
            model(torch.randn(4, 8))
            after = (torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert inside == [(False, False)]
    assert after == (True, True)


def test_threads_keep_their_own_autocast_state() -> None:
    """Autocast's state is per thread (DataParallel runs replicas, which share the hooks, in
    threads): thread A (autocast on) and thread B (off) are both inside forward, A returns
    first, and A's autocast comes back, not B's None."""
    model = _decorated()
    both_inside = threading.Barrier(2, timeout=10)
    a_done = threading.Event()
    results: dict[str, object] = {}

    def meet_inside(module: nn.Module, args: tuple) -> None:
        both_inside.wait()
        if threading.current_thread().name == "B":
            assert a_done.wait(10)

    model.lin.register_forward_pre_hook(meet_inside)

    def run(name: str, autocast: bool) -> None:
        try:
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                model(torch.randn(4, 8))
                results[name] = torch.is_autocast_enabled("cpu")
        except BaseException as e:  # reported below
            results[name] = e
        finally:
            if name == "A":
                a_done.set()

    threads = [threading.Thread(target=run, args=(n, n == "A"), name=n) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"A": True, "B": False}


def test_conv_net_with_fp32_batchnorm_trains_pure_half() -> None:
    """bf16 conv into fp32 BatchNorm with autocast off inside; the same losses as with the
    user's autocast left on (CPU autocast changes none of this net's ops)."""
    x, y = image_data(32)
    runs = []
    for patch in (False, True):
        model = conv_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        amp.decorate(model, opt, dtype=BF16, patch_torch_functions=patch)
        runs.append([seed_step(model, opt, None, x, y, BF16) for _ in range(5)])
    assert all(torch.isfinite(torch.tensor(runs[0])))
    assert runs[0][-1] < runs[0][0]
    assert runs[0] == runs[1]


def test_install_spelling_takes_the_keyword() -> None:
    amp.install()
    try:
        model = Block()
        torch.cuda.amp.aiak_amp_decorate(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dtype=BF16,
            patch_torch_functions=True,
        )
    finally:
        amp.uninstall()
    seen = _probe(model)
    with torch.autocast("cpu", dtype=BF16):
        model(torch.randn(4, 8))
    assert seen["prod"] == (torch.float32, True)
