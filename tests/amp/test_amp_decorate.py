"""decorate(): what it does to the model and optimizer, and every misuse it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _amp_helpers import conv_net, flat, image_data, mlp
from torch import nn

import aiak.amp as amp
from aiak import comm

HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF)
def test_model_cast_half_with_batchnorm_fp32(dtype: torch.dtype) -> None:
    model = conv_net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    same_model, same_opt = amp.decorate(model, opt, dtype=dtype)
    assert same_model is model and same_opt is opt
    for name, p in model.named_parameters():
        assert id(p) == ids[name], "decorate must keep each Parameter object"
        is_bn = isinstance(model[int(name.split(".")[0])], nn.BatchNorm2d)
        assert p.dtype == (torch.float32 if is_bn else dtype), name
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert b.dtype == torch.float32, f"BatchNorm buffer {name} must stay fp32"
    # Masters are the original fp32 values exactly, not the half-rounded ones.
    masters = list(amp.parameters(opt))
    assert all(m.dtype == torch.float32 for m in masters)
    assert torch.equal(flat(masters), flat(before.values()))


def test_keep_batchnorm_fp32_false_casts_everything() -> None:
    model = conv_net()
    amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1), keep_batchnorm_fp32=False)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model[1].running_mean.dtype == torch.float16


def test_forward_casts_inputs_and_outputs() -> None:
    seen = {}

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, idx: torch.Tensor, extra: dict) -> dict:
            seen.update(x=x.dtype, idx=idx.dtype, extra=extra["t"].dtype)
            return {"out": self.lin(x), "pair": (self.lin(extra["t"]), idx)}

    model = Probe()
    amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    out = model(torch.randn(2, 4), torch.arange(2), extra={"t": torch.randn(2, 4)})
    assert seen == {"x": torch.bfloat16, "idx": torch.int64, "extra": torch.bfloat16}
    assert out["out"].dtype == torch.float32
    assert out["pair"][0].dtype == torch.float32 and out["pair"][1].dtype == torch.int64


def test_existing_optimizer_state_moves_to_masters() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    exp_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    params = list(model.parameters())
    amp.decorate(model, opt)
    for p, m in zip(params, amp.parameters(opt)):
        assert torch.equal(opt.state[m]["exp_avg"], exp_avg[id(p)])
    assert not any(p in opt.state for p in params if p.dtype == torch.float16)


def test_lists_of_models_and_optimizers() -> None:
    a, b = mlp(0), mlp(1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    models, opts = amp.decorate([a, b], [oa, ob], dtype=torch.bfloat16)
    assert models == [a, b] and opts == [oa, ob]
    assert amp.state_of(oa) is not amp.state_of(ob)
    # One optimizer over two models is fine too.
    c, d = mlp(2), mlp(3)
    both = torch.optim.SGD([*c.parameters(), *d.parameters()], lr=0.1)
    amp.decorate([c, d], both)
    assert len(list(amp.parameters(both))) == 12  # 6 per mlp


# -- misuse ---------------------------------------------------------------------------------------


def test_decorate_after_dataparallel_is_refused() -> None:
    model = nn.DataParallel(mlp())
    with pytest.raises(RuntimeError, match="call aiak_amp_decorate before DDP"):
        amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_decorate_after_ddp_is_refused(tmp_path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = nn.parallel.DistributedDataParallel(mlp())
        with pytest.raises(RuntimeError, match="call aiak_amp_decorate before DDP"):
            amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        # The DDP model lets go of the group before it is destroyed: its C++ reducer dropping
        # the last reference would join gloo's threads holding the GIL (a deadlock).
        comm.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        model(torch.randn(2, 6))


def test_decorating_twice_is_refused() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.decorate(model, opt)
    with pytest.raises(RuntimeError, match="model is already decorated"):
        amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = mlp()
    opt.param_groups[0]["params"] = list(other.parameters())  # a decorated optimizer, new model
    with pytest.raises(RuntimeError, match="optimizer is already decorated"):
        amp.decorate(other, opt)


def test_optimizer_not_holding_model_params_is_refused() -> None:
    model, stranger = mlp(), mlp(1)
    with pytest.raises(ValueError, match="must hold the model's params"):
        amp.decorate(model, torch.optim.SGD(stranger.parameters(), lr=0.1))
    extra = nn.Parameter(torch.zeros(7, 2))
    with pytest.raises(ValueError, match=r"1 tensors .* shape \(7, 2\)"):
        amp.decorate(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1))
    # Nothing was changed by the refused calls.
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_two_optimizers_sharing_a_param_are_refused() -> None:
    model = mlp()
    o1 = torch.optim.SGD(model.parameters(), lr=0.1)
    o2 = torch.optim.SGD(list(model.parameters())[:1], lr=0.1)
    with pytest.raises(ValueError, match="both hold a parameter"):
        amp.decorate(model, [o1, o2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.float32}, "dtype must be float16 or bfloat16"),
        ({"num_losses": 0}, "num_losses must be in 1"),
        ({"loss_scale": "static"}, "loss_scale must be None, 'dynamic' or a number"),
        ({"min_loss_scale": 2.0**25}, "min_loss_scale must be <= max_loss_scale"),
        ({"max_loss_scale": float("inf")}, "max_loss_scale must be a finite number"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    model = mlp()
    with pytest.raises(ValueError, match=match):
        amp.decorate(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_wrong_types_are_refused() -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"optimizers must be torch\.optim\.Optimizer"):
        amp.decorate(model, object())
    with pytest.raises(TypeError, match=r"models must be nn\.Module"):
        amp.decorate(object(), torch.optim.SGD(model.parameters(), lr=0.1))
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="patch_torch_functions must be a bool"):
            amp.decorate(
                model, torch.optim.SGD(model.parameters(), lr=0.1), patch_torch_functions=bad
            )
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before any cast


def test_parameters_of_an_undecorated_optimizer_is_refused() -> None:
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="was not decorated"):
        amp.parameters(opt)


def test_frozen_params_outside_the_optimizer_are_cast_without_master() -> None:
    model = conv_net()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    amp.decorate(model, opt)
    assert model[0].weight.dtype == torch.float16
    x, y = image_data(8)
    before = model[0].weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, before)
    assert len(list(amp.parameters(opt))) == len(opt.param_groups[0]["params"])
