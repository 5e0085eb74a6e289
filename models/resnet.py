"""ResNets for small images (CIFAR-style): 3x3 stride-1 stem, no initial max-pool, basic blocks, global average
pooling. ResNet-18/34 as He et al. ([2,2,2,2] / [3,4,6,3] blocks, widths 64-512); ResNet-10 = [1,1,1,1] and
ResNet-8 = [1,1,1] (widths 64-256), the compact variants FedCAC and FedRoD use."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from pflkit.core.common.errors import ConfigError
from pflkit.core.api.params import Param, positive

from .base import PROJECTION_PARAM, SplitModel, split_model


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(groups, channels), channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    """conv3x3-norm-ReLU-conv3x3-norm + shortcut (1x1 conv + norm when the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str, gn_groups: int):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=bias)
        self.bn1 = _norm(norm, cout, gn_groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=bias)
        self.bn2 = _norm(norm, cout, gn_groups)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=bias), _norm(norm, cout, gn_groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def build_resnet(input_shape: Sequence[int], num_classes: int, blocks: List[int], width: int = 64,
                 norm: str = "batch", gn_groups: int = 2, projection_dim: int = 0) -> SplitModel:
    """Stem conv3x3(width) + norm + ReLU, stages of basic blocks (width doubling, stride 2 from stage 2),
    adaptive average pool + flatten as ``features``; ``head`` = Linear(final width, num_classes)."""
    if len(input_shape) != 3:
        raise ConfigError(f"model resnet: needs image inputs (C, H, W), the dataset gives shape {tuple(input_shape)}")
    bias = norm == "none"
    layers: List[nn.Module] = [nn.Conv2d(input_shape[0], width, 3, 1, 1, bias=bias), _norm(norm, width, gn_groups),
                               nn.ReLU(inplace=True)]
    cin = width
    for stage, n in enumerate(blocks):
        cout = width * 2 ** stage
        for b in range(n):
            layers.append(BasicBlock(cin, cout, 2 if (stage > 0 and b == 0) else 1, norm, gn_groups))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return split_model(nn.Sequential(*layers), cin, num_classes, projection_dim)


_COMMON = {
    "width": Param(64, "channels of the stem and first stage (doubled per stage)", check=positive),
    "norm": Param("batch", "normalisation layer: batch (BatchNorm, the default), group (GroupNorm) or none",
                  choices=("batch", "group", "none")),
    "gn_groups": Param(2, "groups of GroupNorm (norm=group)", check=positive),
    "projection_dim": PROJECTION_PARAM,
}


def _variant(name: str, blocks: List[int]):
    def make(input_shape: Sequence[int], num_classes: int, width: int = 64, norm: str = "batch",
             gn_groups: int = 2, projection_dim: int = 0) -> SplitModel:
        return build_resnet(input_shape, num_classes, blocks, width, norm, gn_groups, projection_dim)
    make.__name__ = name
    make.__qualname__ = name
    make.__doc__ = f"{name}: CIFAR-style ResNet with basic-block stage counts {blocks}."
    make.params = dict(_COMMON)
    return make


resnet8 = _variant("resnet8", [1, 1, 1])
resnet10 = _variant("resnet10", [1, 1, 1, 1])
resnet18 = _variant("resnet18", [2, 2, 2, 2])
resnet34 = _variant("resnet34", [3, 4, 6, 3])
