"""The feature-extractor / head split every model exposes (FedPer, FedRep, FedCP, FedC2I rely on it), and the
optional projection head every built-in model offers (``model.projection_dim``, MOON's architecture)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pflkit.core.api.params import Param, non_negative


class SplitModel(nn.Module):
    """``forward(x) = head(features(x))``; ``features`` ends in a flat vector of size ``feature_dim``."""

    def __init__(self, features: nn.Module, head: nn.Module, feature_dim: int):
        super().__init__()
        self.features = features
        self.head = head
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def feature_dim(model: nn.Module) -> int:
    dim = getattr(model, "feature_dim", None)
    if dim is None:
        raise TypeError(f"{type(model).__name__} has no feature/head split (feature_dim attribute)")
    return int(dim)


def flat_size(module: nn.Module, input_shape: Sequence[int]) -> int:
    """Output size of ``module`` for one input of ``input_shape`` (computed, not hand-derived)."""
    with torch.no_grad():
        return int(module(torch.zeros(1, *input_shape)).reshape(1, -1).shape[1])


PROJECTION_PARAM = Param(0, "width of a projection head between the features and the classifier: Linear(d, d)-ReLU-"
                            "Linear(d, projection_dim), d = the feature width (MOON's architecture, Li et al., "
                            "CVPR 2021, whose comparison uses it for every method; out_dim 256 there); it becomes "
                            "the end of `features`, so the head classifies the projected vector; 0 = none (default)",
                         check=non_negative)


def split_model(features: nn.Module, feature_dim: int, num_classes: int, projection_dim: int = 0) -> SplitModel:
    """``features`` [+ projection head] + a linear head: the one way the built-in builders finish a model.

    With ``projection_dim`` > 0 the projection head of MOON's ``ModelFedCon`` -- Linear(d, d), ReLU,
    Linear(d, projection_dim) -- is appended to ``features`` (as further items of the Sequential, so the body's
    keys keep their names), and the head maps projection_dim to the classes. The layers are created in that order
    (body, projection, head): the body's initial weights are the same with and without the projection, and with
    ``projection_dim`` 0 the model is exactly the one built before the option existed (same keys, same weights).
    """
    if projection_dim:
        body = list(features) if isinstance(features, nn.Sequential) else [features]
        features = nn.Sequential(*body, nn.Linear(feature_dim, feature_dim), nn.ReLU(),
                                 nn.Linear(feature_dim, projection_dim))
        feature_dim = projection_dim
    return SplitModel(features, nn.Linear(feature_dim, num_classes), feature_dim)
