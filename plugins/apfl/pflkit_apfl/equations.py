"""APFL's mixture and its adaptive alpha as small functions.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461 (2020), Algorithm 1 (APFL)
and the adaptive-alpha update of Section 3 (Eq. 10 there: the gradient of the loss of the mixed model w.r.t. alpha).

    mix          v_bar = alpha v + (1 - alpha) w: the personal model mixes *parameters*, not outputs
    alpha_grad   d f(v_bar) / d alpha = <v - w, grad f(v_bar)>
    alpha_step   alpha <- Proj_[0,1](alpha - eta_alpha <v - w, grad f(v_bar)>)

The local model v is trained through the mixture: grad_v f(v_bar) = alpha grad f(v_bar) (the chain rule, which
the trainer gets from autograd through ``mix``).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

Alpha = Union[float, torch.Tensor]


def mix(v: torch.Tensor, w: torch.Tensor, alpha: Alpha) -> torch.Tensor:
    """alpha v + (1 - alpha) w (alpha 0: exactly w; alpha 1: exactly v)."""
    return alpha * v + (1 - alpha) * w


def alpha_grad(v: Sequence[torch.Tensor], w: Sequence[torch.Tensor], grad_mixed: Sequence[torch.Tensor]
               ) -> torch.Tensor:
    """<v - w, grad f(v_bar)> summed over all parameter tensors."""
    return sum(((vi - wi) * gi).sum() for vi, wi, gi in zip(v, w, grad_mixed))


def alpha_step(alpha: float, grad: float, lr: float) -> float:
    """Proj_[0,1](alpha - lr * grad)."""
    return min(1.0, max(0.0, alpha - lr * grad))
