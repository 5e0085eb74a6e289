"""The 4-layer CNN of FedAvg (McMahan et al.) as used by FedCP/PFLlib: 2 conv + 2 fully connected layers."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from pflkit.core.api.params import Param, positive

from .base import PROJECTION_PARAM, SplitModel, flat_size, split_model


def cnn4(input_shape: Sequence[int], num_classes: int, channels: list = None, hidden: int = 512,
         padding: Optional[int] = None, projection_dim: int = 0) -> SplitModel:
    """Conv5x5(32)-ReLU-MaxPool-Conv5x5(64)-ReLU-MaxPool-FC(512)-ReLU | head FC(num_classes).

    ``padding`` defaults to 0 (the original, for 28x28/32x32 inputs) and to 2 for inputs smaller than 20 pixels
    (e.g. the embedded 8x8 digits), where unpadded 5x5 convolutions would shrink the image away.
    """
    c1, c2 = (32, 64) if channels is None else channels
    if padding is None:
        padding = 0 if min(input_shape[1:]) >= 20 else 2
    conv = nn.Sequential(
        nn.Conv2d(input_shape[0], c1, 5, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=padding), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    flat = flat_size(conv, input_shape)
    features = nn.Sequential(*conv, nn.Linear(flat, hidden), nn.ReLU())
    return split_model(features, hidden, num_classes, projection_dim)


cnn4.params = {
    "channels": Param([32, 64], "channels of the two conv layers", type=list),
    "hidden": Param(512, "width of the fully connected feature layer", check=positive),
    "padding": Param(None, "conv padding (default: 0, or 2 for inputs under 20 px)", type=int),
    "projection_dim": PROJECTION_PARAM,
}
