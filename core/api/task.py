"""What is learned and how it is scored: classification (accuracy) or regression (MSE)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Task:
    """A learning task: its loss for training and its metric for evaluation.

    ``metric_sum`` returns a per-batch *sum* so that per-client and pooled means are exact.
    """

    kind: str  # "classification" | "regression"
    output_dim: int

    @property
    def metric_name(self) -> str:
        """The name of the reported metric: ``accuracy`` (classification) or ``mse`` (regression)."""
        return "accuracy" if self.kind == "classification" else "mse"

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger metric is better (accuracy) or worse (mse): ``best_*`` numbers follow it."""
        return self.kind == "classification"

    def loss(self, output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The task's training loss of ``output`` against ``target``: cross-entropy on class indices
        (classification) or mean squared error (regression); ``reduction`` as in ``torch.nn.functional``."""
        if self.kind == "classification":
            return F.cross_entropy(output, target, reduction=reduction)
        return F.mse_loss(output.reshape(target.shape), target, reduction=reduction)

    def metric_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The metric summed over the batch (correct predictions, or squared error per sample): evaluation adds
        these sums over a client's batches and divides by its sample count once."""
        if self.kind == "classification":
            return (output.argmax(dim=1) == target).sum()
        return F.mse_loss(output.reshape(target.shape), target, reduction="sum") / max(1, target[0].numel())


def classification(num_classes: int) -> Task:
    """A classification task over ``num_classes`` classes (labels ``0 .. num_classes - 1``)."""
    return Task("classification", num_classes)


def regression(output_dim: int = 1) -> Task:
    """A regression task with ``output_dim`` outputs per sample (metric: mean squared error)."""
    return Task("regression", output_dim)
