"""FedCAC's mathematics as small pure functions (Wu et al., ICCV 2023, Section 3.3-3.4).

Where each equation lives:

    Eq. (5)  sensitivity            s = |(theta^{t,E} - theta^{t,0}) * theta^{t,E}|
    Eq. (6)  top_tau_mask           per tensor, the top-tau fraction of s is critical
             critical_masks         Eq. (6) plus the Figure 3 alternatives (random / reversed sensitivity)
    Sec 3.4  overlap_matrix         O_ij, the overlap ratio of critical-parameter locations
    Eq. (7)  threshold              O_avg + (t / beta) * (O_max - O_avg)
    Eq. (8)  time_varying_collaborators   C_i = {j != i : O_ij >= threshold}
             top_k_collaborators    Figure 4's fixed "Number=k" alternative
    Eq. (9)  global_model           w_bar = mean of the uploaded models
    Eq. (10) customized_models      u_i = mean of w_j over C_i plus i itself
    Eq. (11) masked_init            w_i^{t+1} = u_i * M_i + w_bar * (1 - M_i)

Server-side functions take tensors stacked over the round's K participating clients (leading dimension K) and
work on every client at once; nothing loops over individual parameters.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch

State = Mapping[str, torch.Tensor]

SELECTIONS = ("sensitivity", "random", "reverse")
OVERLAPS = ("similarity", "distance")


# -- client side: Eq. (5)-(6) -------------------------------------------------------------------------------
def sensitivity(start: State, end: State) -> dict[str, torch.Tensor]:
    """Eq. (5): ``s = |(theta^{t,E} - theta^{t,0}) * theta^{t,E}|`` for every parameter of every tensor.

    The round's model change stands in for the gradient of the first-order Taylor estimate of Eq. (4).
    """
    return {k: ((end[k] - start[k]) * end[k]).abs() for k in end}


def num_critical(numel: int, tau: float) -> int:
    """How many of a tensor's ``numel`` parameters Eq. (6) marks critical: floor(tau * numel), as the reference.

    The small epsilon keeps e.g. 0.29 * 100 = 28.999999999999996 from flooring to 28.
    """
    return int(math.floor(tau * numel + 1e-9))


def top_tau_mask(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (6) for one parameter tensor: True where ``scores`` is among the top-tau fraction of the tensor.

    Ties: every entry equal to the k-th largest score is critical too (the reference's ``s >= threshold``), so
    a tensor with ties at the cut may hold more than floor(tau * n) critical entries. Entries with zero score
    (the parameter did not move, or is zero) are never critical; the reference code special-cases a zero
    threshold the same way (it moves the threshold to the smallest non-zero score).
    """
    flat = scores.reshape(-1)
    k = num_critical(flat.numel(), tau)
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    kth_largest = torch.topk(flat, k, sorted=False).values.min()
    return (scores >= kth_largest) & (scores > 0)


def random_mask(like: torch.Tensor, tau: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Figure 3 'Random': exactly floor(tau * n) critical entries at uniformly random positions."""
    n = like.numel()
    k = num_critical(n, tau)
    order = torch.randperm(n, generator=generator)[:k].to(like.device)
    flat = torch.zeros(n, dtype=torch.bool, device=like.device)
    flat[order] = True
    return flat.reshape(like.shape)


def critical_masks(scores: State, tau: float, selection: str = "sensitivity",
                   generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """One boolean critical mask per tensor (weights and biases separately), Eq. (6).

    ``selection`` (Figure 3): 'sensitivity' = top-tau by Eq. (5) (the method); 'random' = tau of each tensor at
    random; 'reverse' = the least sensitive entries, i.e. the complement of the top-(1 - tau) selection.
    """
    if selection == "sensitivity":
        return {k: top_tau_mask(s, tau) for k, s in scores.items()}
    if selection == "reverse":
        return {k: ~top_tau_mask(s, 1.0 - tau) for k, s in scores.items()}
    if selection == "random":
        return {k: random_mask(s, tau, generator) for k, s in scores.items()}
    raise ValueError(f"unknown critical selection {selection!r} (choose from {', '.join(SELECTIONS)})")


# -- server side: overlap, Eq. (7)-(8) ----------------------------------------------------------------------
def overlap_matrix(masks: Sequence[torch.Tensor] | torch.Tensor, kind: str = "similarity") -> torch.Tensor:
    """K x K overlap ratios of critical-parameter locations (Section 3.4), float64.

    ``masks``: one boolean tensor stacked over the K clients ([K, ...]), or a sequence of them (one per
    parameter tensor; they are treated as one concatenated mask). ``||M_i - M_j||_1 = c_i + c_j - 2 <M_i, M_j>``
    with ``c_i`` client i's count of critical entries, so one matrix product per tensor gives every pair.

    kind='similarity' (default; the authors' code): ``O_ij = 1 - ||M_i - M_j||_1 / (2 c_i)``, normalised by
    client i's own count and therefore asymmetric; 1 for identical masks. (When c_i = 0: 1 if c_j = 0 too,
    else 0.)
    kind='distance' (the paper's printed formula): ``D_ij = ||M_i - M_j||_1 / (2n)`` is a distance, so it is
    returned as ``1 - D_ij`` to keep Eq. (8)'s ``O_ij >= threshold`` selecting *similar* clients as the text
    intends (taken literally it would select the least similar ones).
    """
    if kind not in OVERLAPS:
        raise ValueError(f"unknown overlap {kind!r} (choose from {', '.join(OVERLAPS)})")
    chunks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    if not chunks:
        raise ValueError("overlap_matrix of no masks")
    K = chunks[0].shape[0]
    device = chunks[0].device
    inner = torch.zeros(K, K, dtype=torch.float64, device=device)
    counts = torch.zeros(K, dtype=torch.float64, device=device)
    n = 0
    for m in chunks:
        # float32 products of 0/1 entries are exact below 2^24 entries per tensor; accumulate in float64
        f = m.reshape(K, -1).to(torch.float32)
        inner += (f @ f.T).to(torch.float64)
        counts += f.sum(dim=1, dtype=torch.float64)
        n += f.shape[1]
    l1 = counts[:, None] + counts[None, :] - 2.0 * inner
    if kind == "distance":
        return 1.0 - l1 / (2.0 * max(n, 1))
    own = counts[:, None].expand(K, K)
    both_empty = (own == 0) & (counts[None, :] == 0)
    sim = 1.0 - l1 / (2.0 * own.clamp_min(1.0))
    return torch.where(own > 0, sim, both_empty.to(torch.float64))


def off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    K = matrix.shape[0]
    return matrix[~torch.eye(K, dtype=torch.bool, device=matrix.device)]


def threshold(overlap: torch.Tensor, t: int, beta: float) -> Optional[float]:
    """Eq. (7): ``O_avg + (t / beta) * (O_max - O_avg)`` over the off-diagonal pairs (None for < 2 clients).

    ``t`` is the 1-based round number. At t = beta the threshold equals O_max; after it no pair qualifies.
    """
    pairs = off_diagonal(overlap)
    if pairs.numel() == 0:
        return None
    o_avg = float(pairs.mean())
    o_max = float(pairs.max())
    return o_avg + (t / beta) * (o_max - o_avg)


def time_varying_collaborators(overlap: torch.Tensor, t: int, beta: float) -> torch.Tensor:
    """Eq. (8): ``C_i = {j != i : O_ij >= Threshold^t}`` as a K x K boolean matrix (row i = C_i).

    Once ``t > beta`` every C_i is empty ("each client trains critical parameters independently"); this is
    enforced explicitly so that it also holds when all overlaps are equal (O_max = O_avg).
    """
    K = overlap.shape[0]
    eye = torch.eye(K, dtype=torch.bool, device=overlap.device)
    thr = threshold(overlap, t, beta)
    if thr is None or t > beta:
        return torch.zeros(K, K, dtype=torch.bool, device=overlap.device)
    return (overlap >= thr) & ~eye


def top_k_collaborators(overlap: torch.Tensor, k: int) -> torch.Tensor:
    """Figure 4 'Number=k': each client collaborates with the k others of highest overlap (ties: lower index)."""
    K = overlap.shape[0]
    k = min(k, K - 1)
    out = torch.zeros(K, K, dtype=torch.bool, device=overlap.device)
    if k <= 0:
        return out
    eye = torch.eye(K, dtype=torch.bool, device=overlap.device)
    scores = overlap.masked_fill(eye, float("-inf"))
    # stable descending order breaks ties by client position
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    out.scatter_(1, order, True)
    return out


# -- server side: Eq. (9)-(11) -----------------------------------------------------------------------------
def global_model(stacked: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. (9): ``w_bar = (1/N) sum_i w_i`` over the stacked uploads [K, ...]; ``weights`` (e.g. sample
    counts, as the reference code) replace the uniform 1/N when given."""
    K = stacked.shape[0]
    if weights is None:
        w = torch.full((K,), 1.0 / K, dtype=stacked.dtype, device=stacked.device)
    else:
        w = weights.to(device=stacked.device, dtype=stacked.dtype)
        w = w / w.sum()
    return torch.tensordot(w, stacked, dims=1)


def customized_models(stacked: torch.Tensor, collaborators: torch.Tensor) -> torch.Tensor:
    """Eq. (10): ``u_i = (1 / (|C_i| + 1)) sum_{j in C_i + {i}} w_j`` for all i at once -> [K, ...].

    ``collaborators`` is the K x K boolean matrix of Eq. (8) (row i = C_i; the diagonal is added here).
    """
    K = stacked.shape[0]
    eye = torch.eye(K, dtype=torch.bool, device=stacked.device)
    mix = (collaborators.to(stacked.device) | eye).to(stacked.dtype)
    mix = mix / mix.sum(dim=1, keepdim=True)
    return torch.tensordot(mix, stacked, dims=1)


def masked_init(customized: torch.Tensor, global_: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. (11): ``w_i^{t+1} = u_i * M_i + w_bar * (J - M_i)`` (broadcasts over a leading client dimension)."""
    return torch.where(mask, customized, global_)
