"""aiak.ops.resnet.convert: a converted torchvision-style ResNet trains exactly like the original
(outputs, gradients, running statistics, state_dict), compiles, and refuses what it cannot fuse."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _tv_resnet import BasicBlock, Bottleneck, ResNet
from torch import nn

from aiak.ops import resnet


def _pair(block, dtype=torch.float64, device="cpu", **kw):
    torch.manual_seed(0)
    model = ResNet(block, **kw).to(device, dtype).to(memory_format=torch.channels_last)
    return model, resnet.convert(copy.deepcopy(model))


def _train_step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _x(dtype=torch.float64, device="cpu", n=4, size=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64).to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("block", [BasicBlock, Bottleneck])
def test_converted_model_trains_like_the_original(block) -> None:
    model, fused = _pair(block, layers=(2, 1, 1, 1))
    for _ in range(2):
        x = _x()
        out, grads = _train_step(model, x)
        out2, grads2 = _train_step(fused, x)
        torch.testing.assert_close(out2, out)
        for name, g in grads.items():
            torch.testing.assert_close(grads2[name], g, msg=name)
    torch.testing.assert_close(fused.state_dict(), model.state_dict())  # running stats, counts
    model.eval()
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(_x()), model(_x()))


def test_state_dict_keys_stay_and_checkpoints_load_both_ways() -> None:
    model, fused = _pair(Bottleneck)
    assert list(fused.state_dict()) == list(model.state_dict())
    buf = io.BytesIO()
    torch.save(fused, buf)  # the replaced forwards pickle (module-level functions)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(_x()), model.eval()(_x()))


def test_momentum_none_and_untracked_stats_follow_torch() -> None:
    model, fused = _pair(BasicBlock)
    for m in (model, fused):
        m.layer1[0].bn1.momentum = None
    x = _x()
    for _ in range(3):
        _train_step(model, x)
        _train_step(fused, x)
    torch.testing.assert_close(fused.state_dict(), model.state_dict())
    torch.manual_seed(0)
    plain = ResNet(BasicBlock).double()
    for m in plain.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    fused = resnet.convert(copy.deepcopy(plain))
    plain.eval()
    fused.eval()  # no running stats: batch statistics even in eval, as torch does
    with torch.no_grad():
        torch.testing.assert_close(fused(_x()), plain(_x()))


def test_compiled_converted_model_matches_eager() -> None:
    _, fused = _pair(BasicBlock, dtype=torch.float32)
    ref = copy.deepcopy(fused)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True)
    x = _x(torch.float32)
    out, _ = _train_step(compiled, x)
    grads = {n: p.grad for n, p in fused.named_parameters()}
    out2, grads2 = _train_step(ref, x)
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    for name, g in grads2.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_convert_refuses_models_without_resnet_blocks() -> None:
    with pytest.raises(ValueError, match="no torchvision-style BasicBlock or Bottleneck"):
        resnet.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        resnet.convert("resnet50")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("block", [BasicBlock, Bottleneck])
def test_cuda_converted_model_is_as_close_to_float64_as_torch_in_fp16(block, recwarn) -> None:
    # Both fp16 runs differ from the exact (float64) one by rounding; at the ReLU's kink torch's
    # rounding of the batch norm before the add and the kernel's single rounding pick
    # different sides, so the two fp16 runs are compared through their error to float64.
    exact, _ = _pair(block, dtype=torch.float64, device="cuda", width=16)
    model, fused = _pair(block, dtype=torch.float32, device="cuda", width=16)
    for m in (model, fused):  # O2's layout: half convs and linear, fp32 batch norm
        for mod in m.modules():
            if not isinstance(mod, nn.BatchNorm2d):
                for p in mod.parameters(recurse=False):
                    p.data = p.data.half()
    x = _x(torch.float16, "cuda", n=16, size=64)
    want, exact_grads = _train_step(exact, x.double())
    out, grads = _train_step(model, x)
    out2, grads2 = _train_step(fused, x)
    assert not [w for w in recwarn if "batch_norm_act" in str(w.message)]  # no fallback
    assert _rel(out2, want) <= 1.5 * _rel(out, want) + 1e-3
    for name, g in exact_grads.items():
        theirs, ours = _rel(grads[name], g), _rel(grads2[name], g)
        assert ours <= 1.5 * theirs + 5e-3, (name, ours, theirs)
