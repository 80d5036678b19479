"""``convert(model)``: a torchvision-style ResNet whose batch norms run ``aiak::batch_norm_act``
with the ReLU and residual add that follow them.

What changes (parameters, buffers and ``state_dict`` keys stay; only ``forward`` methods are
replaced, per instance):

- every ``BasicBlock`` / ``Bottleneck`` (torchvision's attribute names: ``conv1``, ``bn1``, ...,
  ``relu``, ``downsample``): ``bn1`` + ReLU and ``bn2`` + ReLU (and, in a bottleneck, ``bn3``)
  fused, the last batch norm with the residual add and the block's final ReLU;
- the model's stem (``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1``..``layer4``,
  ``avgpool``, ``fc``): ``bn1`` + ReLU fused.

The downsample branch's batch norm (no ReLU after it) stays torch's. Under ``torch.compile``
the converted forwards run torch's batch norm, add and ReLU: inductor fuses those itself, and
the op would split its fusion. Evaluation mode runs torch's ops too (the op's kernels are for
batch statistics). Modules are recognised by their attributes (torchvision is not imported).
"""

from __future__ import annotations

import torch
from torch import nn

from aiak.ops._bound import Bound
from aiak.ops.batch_norm_act import batch_norm_act

__all__ = ["bn_act", "convert"]

_BLOCK_ATTRS = ("conv1", "bn1", "conv2", "bn2", "relu", "downsample")
_STEM_ATTRS = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")


def bn_act(
    bn: nn.modules.batchnorm._BatchNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    relu: bool = True,
) -> torch.Tensor:
    """``relu(bn(x) + residual)`` with ``bn``'s own bookkeeping (``num_batches_tracked``,
    ``momentum=None``'s cumulative average), as ``nn.BatchNorm*.forward`` does it."""
    if torch.compiler.is_compiling():
        y = bn(x)
        if residual is not None:
            y = y + residual
        return torch.relu(y) if relu else y
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / float(bn.num_batches_tracked)
    training = bn.training or (bn.running_mean is None and bn.running_var is None)
    keep = not bn.training or bn.track_running_stats
    return batch_norm_act(
        x,
        bn.running_mean if keep else None,
        bn.running_var if keep else None,
        bn.weight,
        bn.bias,
        training,
        factor,
        bn.eps,
        residual,
        relu,
    )


def _basic_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = bn_act(self.bn1, self.conv1(x))
    out = self.conv2(out)
    identity = x if self.downsample is None else self.downsample(x)
    return bn_act(self.bn2, out, identity)


def _bottleneck_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = bn_act(self.bn1, self.conv1(x))
    out = bn_act(self.bn2, self.conv2(out))
    out = self.conv3(out)
    identity = x if self.downsample is None else self.downsample(x)
    return bn_act(self.bn3, out, identity)


def _resnet_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = self.maxpool(bn_act(self.bn1, self.conv1(x)))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return self.fc(torch.flatten(self.avgpool(x), 1))


def _is_bn(m: object) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def _is_block(m: nn.Module) -> bool:
    if not all(hasattr(m, a) for a in _BLOCK_ATTRS):
        return False
    if not (isinstance(m.relu, nn.ReLU) and _is_bn(m.bn1) and _is_bn(m.bn2)):
        return False
    name = type(m).__name__
    if name == "Bottleneck":
        return hasattr(m, "conv3") and _is_bn(getattr(m, "bn3", None))
    return name == "BasicBlock"


def _is_stem(m: nn.Module) -> bool:
    return (
        all(hasattr(m, a) for a in (*_STEM_ATTRS, "avgpool", "fc"))
        and isinstance(m.relu, nn.ReLU)
        and _is_bn(m.bn1)
    )


def convert(model: nn.Module) -> nn.Module:
    """Fuse ``model``'s batch norm + (add +) ReLU in place; returns ``model``.

    Raises ``ValueError`` when nothing in ``model`` is a torchvision-style ResNet block."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"resnet.convert: model must be an nn.Module, got {type(model).__name__}")
    blocks = 0
    for m in model.modules():
        if _is_block(m):
            fwd = _bottleneck_forward if type(m).__name__ == "Bottleneck" else _basic_forward
            m.forward = Bound(fwd, m)
            blocks += 1
        elif _is_stem(m):
            m.forward = Bound(_resnet_forward, m)
    if blocks == 0:
        raise ValueError(
            "resnet.convert: no torchvision-style BasicBlock or Bottleneck found in the model "
            "(conv1, bn1, conv2, bn2[, conv3, bn3], relu, downsample)"
        )
    return model
