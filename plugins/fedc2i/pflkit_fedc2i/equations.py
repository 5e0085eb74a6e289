"""FedC2I's mathematics as small pure functions (Tan, Long, Jiang, Zhang: "Influence-Oriented Personalized
Federated Learning", Sections "Client-Level Influence Measure" and "Class-Level Influence Measure").

Where each equation lives:

    Eq. (4)  leave_one_out_mean      theta^{-i} = 1/(M-1) sum_{j != i} theta_j        (also Eq. 7's row means)
    Eq. (5)  influence_weights       lambda_m^i = [l_m^{-i}]^gamma / sum_i [l_m^{-i}]^gamma
    Eq. (6)  weighted_sum            theta_bar_m = sum_i lambda_m^i theta_i
    Eq. (7)  class_level_losses      loss of phi_m with row c replaced by phi_c^{-i}, for every (i, c)
    Eq. (8)-(9) influence_weights    Lambda_m^{i,c}: the same normalisation over i, per class c
    Eq. (10) classifier_rows         phi_bar_{m,c} = sum_i Lambda_m^{i,c} phi_{i,c}   (reading 'weighted')
                                     sum_i Lambda_m^{i,c} phi_{m,c} = phi_{m,c}      (reading 'printed')

Tensors carry the M clients in their leading dimension (client order = sorted client ids). A classifier is a
weight matrix ``W`` [C, d] plus a bias ``b`` [C]; the class vector phi_c is the pair (W[c], b[c]), so a row
replacement or a row aggregation moves the weight row and the bias entry together.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

EQ10_READINGS = ("weighted", "printed")


def leave_one_out_mean(stacked: torch.Tensor) -> torch.Tensor:
    """Eq. (4) for every i at once: ``out[i] = mean of stacked[j] over j != i`` ([M, ...] -> [M, ...]).

    Computed as ``(sum - x_i) / (M - 1)``: one pass over the stack instead of M sums. Needs M >= 2 (with a single
    client there is nothing to leave out).
    """
    m = stacked.shape[0]
    if m < 2:
        raise ValueError("leave-one-out needs at least two clients")
    total = stacked.sum(dim=0, keepdim=True)
    return (total - stacked) / (m - 1)


def influence_weights(losses: torch.Tensor, gamma: float, dim: int = 0) -> torch.Tensor:
    """Eq. (5) (and Eq. 9 along ``dim`` = the client axis): ``l^gamma / sum l^gamma`` over ``dim``.

    Evaluated as ``softmax(gamma * log l)`` in float64, which is the same quantity without overflow for large
    gamma. gamma = 0 gives exactly uniform weights (the paper: "all clients share the same aggregation weight").
    Losses are non-negative; a zero loss has weight 0 for gamma > 0 (0^gamma), and if every loss on the axis is
    zero the weights are uniform (0/0 read as "no client is distinguishable").
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    l = losses.to(torch.float64)
    if (l < 0).any():
        raise ValueError("influence losses must be non-negative")
    n = l.shape[dim]
    if gamma == 0:
        return torch.full_like(l, 1.0 / n)
    logs = torch.log(l)  # -inf for a zero loss: weight exactly 0
    all_zero = torch.isneginf(logs).all(dim=dim, keepdim=True)
    w = torch.softmax(gamma * torch.where(all_zero, torch.zeros_like(logs), logs), dim=dim)
    return w


def weighted_sum(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Eq. (6): ``sum_i w_i x_i`` over the leading client dimension ([M, ...], [M] -> [...]), in x's dtype."""
    w = weights.to(device=stacked.device, dtype=torch.float64)
    return torch.tensordot(w, stacked.to(torch.float64), dims=1).to(stacked.dtype)


def weighted_state(states: Sequence[Mapping[str, torch.Tensor]], weights: torch.Tensor,
                   own: Mapping[str, torch.Tensor]) -> dict:
    """Eq. (6) applied to every floating tensor of a state dict; integer tensors (e.g. batch-norm counters) keep
    ``own``'s value (they are counts, not parameters)."""
    out = {}
    for k, v in own.items():
        if v.is_floating_point():
            out[k] = weighted_sum(torch.stack([s[k] for s in states]), weights)
        else:
            out[k] = v.clone()
    return out


def class_level_losses(features: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       loo_weight: torch.Tensor, loo_bias: torch.Tensor,
                       loss: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Eq. (7)-(8): ``l_m^{i,-c}`` for every client i and class c -> [M, C].

    ``features`` [B, d] are the batch's features, computed once: replacing one classifier row changes only that
    class's logit, so all M x C leave-one-out classifiers are evaluated from one [B, C] logit matrix of phi_m
    (``weight`` [C, d], ``bias`` [C]) and one [M, B, C] matrix of replacement logits from the leave-one-out rows
    (``loo_weight`` [M, C, d], ``loo_bias`` [M, C]). ``loss(logits, y, reduction="none")`` is the task's loss.
    """
    m, c = loo_bias.shape
    base = features @ weight.T + bias                                       # [B, C] logits of phi_m
    repl = torch.einsum("bd,mcd->mbc", features, loo_weight) + loo_bias[:, None, :]  # [M, B, C]
    swap = torch.eye(c, dtype=torch.bool, device=features.device)          # swap[c, k]: column k is class c's row
    # logits[i, c, b, k] = repl[i, b, k] if k == c else base[b, k]
    logits = torch.where(swap[None, :, None, :], repl[:, None, :, :], base[None, None, :, :])  # [M, C, B, C]
    b = features.shape[0]
    per_sample = loss(logits.reshape(m * c * b, c), y.repeat(m * c), reduction="none")
    return per_sample.reshape(m, c, b).mean(dim=2)


def classifier_rows(weights: torch.Tensor, biases: torch.Tensor, influence: torch.Tensor, own: int,
                    reading: str = "weighted") -> tuple:
    """Eq. (10): the personalised classifier of client ``own`` (its index in the client axis).

    ``weights`` [M, C, d], ``biases`` [M, C], ``influence`` = Lambda_m [M, C] (each column sums to 1).
    reading='weighted' (default): ``phi_bar_{m,c} = sum_i Lambda^{i,c} phi_{i,c}`` -- row c is the
    influence-weighted mix of every client's row c. reading='printed': the formula as printed,
    ``sum_i Lambda^{i,c} phi_{m,c}``, which is ``phi_{m,c}`` itself since the weights sum to 1.
    """
    if reading == "printed":
        return weights[own].clone(), biases[own].clone()
    if reading != "weighted":
        raise ValueError(f"unknown Eq. 10 reading {reading!r} (choose from {', '.join(EQ10_READINGS)})")
    lam = influence.to(device=weights.device, dtype=torch.float64)
    w = torch.einsum("mc,mcd->cd", lam, weights.to(torch.float64)).to(weights.dtype)
    b = (lam * biases.to(torch.float64)).sum(dim=0).to(biases.dtype)
    return w, b
