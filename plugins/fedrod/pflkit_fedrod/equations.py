"""FedRoD's two objectives and its personalized prediction as small pure functions.

Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", ICLR 2022.
Notation: client m holds ``N_{m,c}`` training samples of class c; the feature extractor ``f(x; theta)`` and the
generic head ``g(z; psi)`` are shared (FedAvg), the personalized head ``h(z; phi_m)`` stays on client m.

    class_counts             N_{m,c}, the client's per-class training counts (computed on the client, never sent)
    balanced_softmax_loss    the balanced-risk surrogate that trains {theta, psi}: Balanced Softmax (BSM,
                             Ren et al., NeurIPS 2020) -log(N_{m,y}^gamma e^{g_y} / sum_c N_{m,c}^gamma e^{g_c})
    personalized_logits      the personalized model's scores: g(z; psi) + h(z; phi_m)
    personalized_loss        the empirical risk (cross-entropy) of the personalized scores; it trains phi_m only
                             (features and generic scores enter detached)

The paper's equation numbers are not cited here: this implementation was written without a copy of the paper at
hand (see the plugin README, "Provenance"), so the formulas are named, not numbered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``N_{m,c}`` for c = 0..num_classes-1 (float, on the labels' device)."""
    return torch.bincount(labels.reshape(-1).long(), minlength=num_classes)[:num_classes].to(torch.float32)


def balanced_softmax_loss(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor, gamma: float = 1.0,
                          reduction: str = "mean") -> torch.Tensor:
    """Balanced Softmax: ``-log( N_y^gamma exp(g_y) / sum_c N_c^gamma exp(g_c) )`` = CE(g + gamma * log N, y).

    Adding the log class prior to the logits during training makes the *un-adjusted* logits estimate the
    class-balanced posterior, so every client optimises the same balanced risk whatever its label skew (the
    paper's "balanced risk minimisation" for the generic model). gamma = 1 is Balanced Softmax proper; other
    gammas are the logit-adjusted generalisation; gamma = 0 is plain cross-entropy (an ablation: no BRM).
    A class the client does not hold (N_c = 0) has prior 0, i.e. it drops out of the client's softmax.
    """
    if gamma == 0:
        return F.cross_entropy(logits, labels, reduction=reduction)
    prior = gamma * counts.to(device=logits.device, dtype=logits.dtype).log()  # log 0 = -inf: class excluded
    return F.cross_entropy(logits + prior, labels, reduction=reduction)


def personalized_logits(generic_logits: torch.Tensor, personal_logits: torch.Tensor) -> torch.Tensor:
    """The personalized prediction: the generic head's scores plus the personalized head's (additive module)."""
    return generic_logits + personal_logits


def personalized_loss(generic_logits: torch.Tensor, personal_logits: torch.Tensor, labels: torch.Tensor,
                      reduction: str = "mean") -> torch.Tensor:
    """Empirical risk of the personalized scores; gradients reach only the personalized head.

    The generic scores enter detached, so this loss never moves {theta, psi}: the generic model is trained by
    the balanced loss alone (the personalized head's input features must be detached by the caller as well).
    """
    return F.cross_entropy(personalized_logits(generic_logits.detach(), personal_logits), labels,
                           reduction=reduction)
