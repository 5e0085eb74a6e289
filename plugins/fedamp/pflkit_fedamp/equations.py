"""FedAMP's equations as small functions on tensors.

Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021.
The objective is  min_W  sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2)  with A(x) = 1 - exp(-x / sigma), solved
by alternating a gradient step on the attention term (the server's "attentive message passing") and a proximal
step on the clients' losses:

    exp_attention      FedAMP's message-passing weights: xi_ij = alpha_k A'(||w_i - w_j||^2)
                       = (alpha_k / sigma) exp(-||w_i - w_j||^2 / sigma) for j != i
    cosine_attention   HeurFedAMP's weights for deep networks: xi_ij = (1 - xi_ii) softmax_{j != i}(sigma cos(w_i, w_j)),
                       xi_ii a fixed self weight
    self_weight        xi_ii = 1 - sum_{j != i} xi_ij (the weights of a cloud model sum to one)
    cloud_model        u_i = xi_ii w_i + sum_{j != i} xi_ij w_j (the personalised cloud model)
    prox_coefficient   lambda / (2 alpha_k), the weight of ||w - u_i||^2 in the client's problem
                       w_i = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2

(The paper's text was not available offline when this was written, so its equation numbers are not cited; the
functions are named after the quantities above, as BASELINES.md section 3.1 transcribes them.)
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Sequence

import torch


def exp_attention(sq_dists: torch.Tensor, alpha_k: float, sigma: float) -> torch.Tensor:
    """xi_ij = (alpha_k / sigma) exp(-d_ij / sigma) for the squared distances ``d_ij`` to the other clients."""
    return (alpha_k / sigma) * torch.exp(-sq_dists / sigma)


def cosine_attention(cosines: torch.Tensor, sigma: float, xi_ii: float) -> torch.Tensor:
    """xi_ij = (1 - xi_ii) exp(sigma cos_ij) / sum_h exp(sigma cos_ih) over the other clients (HeurFedAMP)."""
    if cosines.numel() == 0:
        return cosines
    return (1.0 - xi_ii) * torch.softmax(sigma * cosines, dim=0)


def self_weight(others: torch.Tensor) -> float:
    """xi_ii = 1 - sum_{j != i} xi_ij."""
    return 1.0 - float(others.sum()) if others.numel() else 1.0


def cloud_model(own: Mapping[str, torch.Tensor], xi_ii: float, others: Sequence[Mapping[str, torch.Tensor]],
                weights: Sequence[float]) -> Dict[str, torch.Tensor]:
    """u_i = xi_ii w_i + sum_j xi_ij w_j over the floating-point entries (others, e.g. BatchNorm's batch counter,
    stay w_i's); terms with weight 0 are skipped, so xi_ii = 1 returns exactly w_i's values."""
    out = start_cloud(own, xi_ii)
    for state, w in zip(others, weights):
        add_to_cloud(out, state, w)
    return out


def start_cloud(own: Mapping[str, torch.Tensor], xi_ii: float) -> Dict[str, torch.Tensor]:
    """xi_ii w_i (floating-point entries; the others copied): the first term of ``cloud_model``."""
    return {k: v * xi_ii if v.is_floating_point() else v.clone() for k, v in own.items()}


def add_to_cloud(acc: Dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], w: float) -> None:
    """acc += w * state on the floating-point entries (in place of ``acc``'s tensors; nothing when w is 0): one
    term of ``cloud_model``, so the server can stream the other clients' models one at a time."""
    if w == 0.0:
        return
    for k, v in acc.items():
        if v.is_floating_point():
            acc[k] = v + state[k].to(v.dtype) * w


def prox_coefficient(lam: float, alpha_k: float) -> float:
    """lambda / (2 alpha_k): the weight of ||w - u_i||^2 in the client's problem; 0 when lambda is 0 (no pull)."""
    if lam == 0.0:
        return 0.0
    if alpha_k <= 0.0:
        return math.inf
    return lam / (2.0 * alpha_k)


def squared_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """||a - b||^2 of two models given as matching lists of tensors (float64, tensor by tensor: no flat copy)."""
    return sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b))


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """<a, b> of two models given as matching lists of tensors (float64, tensor by tensor)."""
    return sum(float(torch.dot(x.reshape(-1).double(), y.reshape(-1).double())) for x, y in zip(a, b))


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """cos(a, b) = <a, b> / (||a|| ||b||) (0 when either is the zero vector)."""
    return cosine_from(dot(a, b), math.sqrt(dot(a, a)), math.sqrt(dot(b, b)))


def cosine_from(ab: float, norm_a: float, norm_b: float) -> float:
    """<a, b> / (||a|| ||b||) from precomputed parts (the server computes each model's norm once per round)."""
    return ab / (norm_a * norm_b) if norm_a > 0 and norm_b > 0 else 0.0
