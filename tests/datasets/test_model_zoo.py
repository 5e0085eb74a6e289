"""LeNet (FedC2I Table 7), CIFAR-style ResNets and fastText: shapes, feature/head split, parameter counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pflkit.core.api import registry as reg
from pflkit.core.engine.config import resolve
from pflkit.core.common.errors import ConfigError
from pflkit.models.base import SplitModel
from pflkit.models.fasttext import fasttext
from pflkit.models.lenet import lenet
from pflkit.models.resnet import resnet8, resnet10, resnet18, resnet34


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_lenet_is_table_7():
    m = lenet((3, 64, 64), 10)
    linears = [l for l in m.modules() if isinstance(l, nn.Linear)]
    convs = [l for l in m.modules() if isinstance(l, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(3, 64, (5, 5)), (64, 64, (5, 5))]
    assert [(l.in_features, l.out_features) for l in linears] == [(64 * 13 * 13, 384), (384, 192), (192, 10)]
    assert sum(isinstance(l, nn.MaxPool2d) for l in m.modules()) == 2
    # Table 7 layer by layer: 4,864 + 102,464 + 4,153,728 + 73,920 + 1,930
    assert n_params(m) == 4_336_906
    assert m.feature_dim == 192 and m.head is linears[-1]
    x = torch.randn(2, 3, 64, 64)
    assert m.features(x).shape == (2, 192) and m(x).shape == (2, 10)
    small = lenet((3, 32, 32), 10)  # 32x32 inputs: the first FC takes 64*5*5
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert [l.in_features for l in small.modules() if isinstance(l, nn.Linear)][0] == 64 * 5 * 5


@pytest.mark.parametrize("builder,blocks,dim", [(resnet8, 3, 256), (resnet10, 4, 512), (resnet18, 8, 512),
                                                (resnet34, 16, 512)])
def test_resnets_shapes_and_split(builder, blocks, dim):
    m = builder((3, 32, 32), 7, width=8)  # narrow copies keep the test fast; the layout is the same
    dim = dim // 8
    assert isinstance(m, SplitModel) and m.feature_dim == dim
    assert sum(type(mod).__name__ == "BasicBlock" for mod in m.modules()) == blocks
    stem = m.features[0]
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)  # CIFAR stem
    assert not any(isinstance(mod, nn.MaxPool2d) for mod in m.modules())
    assert any(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    x = torch.randn(2, 3, 16, 16)  # global pooling: any size works; small keeps the test fast
    with torch.no_grad():
        assert m.features(x).shape == (2, dim) and m(x).shape == (2, 7)
    assert all(k.startswith(("features.", "head.")) for k in m.state_dict())


def test_resnet_parameter_counts():
    assert n_params(resnet18((3, 32, 32), 10)) == 11_173_962  # the well-known ~11.2M of CIFAR ResNet-18
    assert n_params(resnet34((3, 32, 32), 100)) == 21_328_292
    gn = resnet8((1, 16, 16), 10, norm="group")
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in gn.modules())
    assert gn(torch.randn(3, 1, 16, 16)).shape == (3, 10)


def test_fasttext_mean_ignores_padding():
    torch.manual_seed(0)
    m = fasttext((12,), 4, vocab_size=50, embed_dim=8, hidden=6)
    assert m.feature_dim == 6
    tokens = torch.tensor([[5, 9, 3, 0, 0, 0], [7, 7, 0, 0, 0, 0]])
    padded = torch.cat([tokens, torch.zeros(2, 6, dtype=torch.long)], dim=1)
    assert m(tokens).shape == (2, 4)
    assert torch.allclose(m.features(tokens), m.features(padded))  # padding never dilutes the mean
    emb = m.features[0].embedding.weight
    assert torch.allclose(m.features[0](tokens)[0], emb[[5, 9, 3]].mean(0))
    plain = fasttext((12,), 4, vocab_size=50, embed_dim=8, hidden=0)
    assert plain.feature_dim == 8 and plain.head.in_features == 8


def test_models_registered_and_params_validated():
    for name in ("lenet", "resnet8", "resnet10", "resnet18", "resnet34", "fasttext"):
        assert isinstance(reg.MODELS.get(name).params, dict)
    cfg = resolve([{"model": {"name": "resnet10", "norm": "group"}}])
    assert cfg.model.norm == "group"
    with pytest.raises(ConfigError, match="model.hidden.*two positive integers"):
        resolve([{"model": {"name": "lenet", "hidden": [32]}}])
    with pytest.raises(ConfigError, match="model.norm"):
        resolve([{"model": {"name": "resnet18", "norm": "layer"}}])
