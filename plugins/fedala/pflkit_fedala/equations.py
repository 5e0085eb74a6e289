"""FedALA's adaptive local aggregation (ALA) as small functions.

Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
AAAI 2023, Section "Adaptive Local Aggregation (ALA)" and Algorithm 1. Client i holds its old local model theta_i
and receives the global model Theta; on the top p layers it initialises its new local model element-wise as

    ala_init     theta_hat = theta_i + (Theta - theta_i) * W         (W in [0, 1], one weight per parameter entry)
    ala_step     W <- clip_[0,1](W - eta * grad_{theta_hat} L * (Theta - theta_i))

(the lower layers take Theta as they are). ``ala_init`` computes the same value as Theta + (theta_i - Theta) *
(1 - W): at W = 1 that is Theta bit for bit (theta_i + (Theta - theta_i) need not be), so FedALA with its weights
fixed at 1 is FedAvg exactly.

``layer_groups`` / ``top_layer_keys`` say what "the top p layers" are: the parameters of one module (a Linear's
weight and bias) form one layer, as in the paper (PFLlib's ``-p`` counts parameter *tensors* instead).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch


def ala_init(local: torch.Tensor, received: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """theta_i + (Theta - theta_i) * W, written as Theta + (theta_i - Theta) * (1 - W) (exactly Theta at W = 1)."""
    return received + (local - received) * (1 - weights)


def ala_step(weights: torch.Tensor, grad: torch.Tensor, local: torch.Tensor, received: torch.Tensor,
             eta: float) -> torch.Tensor:
    """clip_[0,1](W - eta * dL/dtheta_hat * (Theta - theta_i)): d theta_hat / d W = Theta - theta_i."""
    return torch.clamp(weights - eta * grad * (received - local), 0.0, 1.0)


def layer_groups(param_names: Sequence[str]) -> List[List[str]]:
    """Parameter names grouped by their module (``features.3.weight`` + ``features.3.bias``), in model order."""
    groups: Dict[str, List[str]] = {}
    for name in param_names:
        groups.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return list(groups.values())


def top_layer_keys(param_names: Sequence[str], p: int) -> List[str]:
    """The parameter names of the last ``p`` layers (all of them when there are fewer)."""
    return [k for group in layer_groups(param_names)[-p:] for k in group] if p > 0 else []


def converged(losses: Sequence[float], window: int, threshold: float) -> bool:
    """The start phase's stopping rule: more than ``window`` losses and the std of the last ``window`` below
    ``threshold`` (the authors' code)."""
    return len(losses) > window and float(np.std(losses[-window:])) < threshold
