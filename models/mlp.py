"""Multi-layer perceptron with a linear head."""
from __future__ import annotations

import math
from typing import Sequence

from torch import nn

from pflkit.core.api.params import Param

from .base import PROJECTION_PARAM, SplitModel, split_model


def mlp(input_shape: Sequence[int], num_classes: int, hidden: list = None, dropout: float = 0.0,
        projection_dim: int = 0) -> SplitModel:
    """MLP: flatten -> [Linear -> ReLU]* -> Linear head."""
    hidden = [200, 200] if hidden is None else list(hidden)
    layers: list = [nn.Flatten()]
    width = int(math.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    return split_model(nn.Sequential(*layers), width, num_classes, projection_dim)


mlp.params = {
    "hidden": Param([200, 200], "hidden layer widths", type=list),
    "dropout": Param(0.0, "dropout after each hidden layer",
                     check=lambda v: None if 0 <= v < 1 else "must lie in [0, 1)"),
    "projection_dim": PROJECTION_PARAM,
}
