"""pFedMe's three update rules as small functions on lists of tensors.

T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020, Algorithm 1.
Client i's personal model theta_i is the proximal point of its loss f_i around its copy w of the global model
(the Moreau envelope's minimiser): theta_i(w) = argmin_theta f_i(theta) + lambda/2 ||theta - w||^2.

    inner_step     one of the K gradient steps that approximately solve that problem on a mini-batch D:
                   theta <- theta - eta_p [grad f_i(theta; D) + lambda (theta - w)]
    local_w_step   the client's update of its copy of w after the K inner steps:
                   w <- w - eta lambda (w - theta)
    beta_mix       the server's update: w^{t+1} = (1 - beta) w^t + beta * mean_i w_i  (beta = 1: plain mean)

The trainer runs ``inner_step`` through the configured optimizer (same step, plus train.momentum / weight_decay /
max_grad_norm when set: the references' extra ``mu theta`` term is exactly weight decay mu).
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def inner_step(theta: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor],
               personal_lr: float, lam: float) -> List[torch.Tensor]:
    """theta - eta_p [grad f(theta; D) + lambda (theta - w)] (Algorithm 1, the inner solver of the personal problem)."""
    return [t - personal_lr * (g + lam * (t - w)) for t, g, w in zip(theta, grads, anchor)]


def local_w_step(w: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], lr: float, lam: float
                 ) -> List[torch.Tensor]:
    """w - eta lambda (w - theta) (Algorithm 1, the local update of w_{i,r})."""
    return [wi - lr * lam * (wi - ti) for wi, ti in zip(w, theta)]


def beta_mix(previous: torch.Tensor, mean: torch.Tensor, beta: float) -> torch.Tensor:
    """(1 - beta) w^t + beta * mean of the uploads (Algorithm 1, server update); beta = 1 returns ``mean`` itself."""
    if beta == 1.0:
        return mean
    return (1.0 - beta) * previous + beta * mean
