"""The feature-extractor / head split every model exposes (FedPer, FedRep, FedCP, FedC2I rely on it)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


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
