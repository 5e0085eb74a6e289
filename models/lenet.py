"""The LeNet of FedC2I's Table 7 (appendix A)."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from pflkit.core.api.params import Param

from .base import PROJECTION_PARAM, SplitModel, flat_size, split_model


def lenet(input_shape: Sequence[int], num_classes: int, channels: list = None, hidden: list = None,
          projection_dim: int = 0, dropout: float = 0.0) -> SplitModel:
    """FedC2I's LeNet (Table 7): two unpadded 5x5 convolutions of 64 channels, each with ReLU and 2x2
    max-pooling, then FC(384)-ReLU-FC(192)-ReLU and the FC(num_classes) classifier.

    Layer by layer, as the table numbers them: 1 CONV(in, 64, k=5), ReLU; 2 MaxPool(2, 2); 3 CONV(64, 64, k=5), ReLU; 4 MaxPool(2, 2);
    5 FC(64*13*13, 384), ReLU; 6 FC(384, 192), ReLU; 8 FC(192, num_classes)  (the table has no row 7).

    Layers 1-6 are the feature extractor theta (feature_dim 192) and layer 8 the classifier phi. Convolutions are
    unpadded, so the first FC's input size follows from the image size: the table's 64*13*13 is that of 64x64
    inputs (32x32 inputs give 64*5*5); it is computed, not hard-coded.

    ``hidden = [120, 64]`` with ``dropout = 0.6`` (dropout after the second FC layer's ReLU) is FedRep's CNNCifar,
    the PCFL authors' CIFAR-10 "two-layer CNN".
    """
    c1, c2 = (64, 64) if channels is None else channels
    h1, h2 = (384, 192) if hidden is None else hidden
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], c1, kernel_size=5), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Conv2d(c1, c2, kernel_size=5), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2), nn.Flatten())
    flat = flat_size(conv, input_shape)
    drop = [nn.Dropout(dropout)] if dropout > 0 else []  # no module at 0: the state and the numbers stay as they were
    features = nn.Sequential(*conv, nn.Linear(flat, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), *drop)
    return split_model(features, h2, num_classes, projection_dim)


def _two_positive_ints(v) -> Optional[str]:
    ok = len(v) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in v)
    return None if ok else "must be a list of two positive integers"


lenet.params = {
    "channels": Param([64, 64], "output channels of the two conv layers (Table 7: 64, 64)", type=list,
                      check=_two_positive_ints),
    "hidden": Param([384, 192], "widths of the two FC feature layers (Table 7: 384, 192)", type=list,
                    check=_two_positive_ints),
    "projection_dim": PROJECTION_PARAM,
    "dropout": Param(0.0, "dropout rate after the second FC layer (FedRep's CIFAR CNN: 0.6); 0 = none", type=float,
                     check=lambda v: None if 0 <= v < 1 else "must lie in [0, 1)"),
}
