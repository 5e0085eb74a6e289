"""FedFomo's equations as small functions.

Zhang, Sapra, Fidler, Yeung, Alvarez, "Personalized Federated Learning with First Order Model Optimization",
ICLR 2021, Section 3 (the first-order model optimisation and the server's model selection):

    fomo_weights      w_n = max(0, (L_i(theta_i^{t-1}) - L_i(theta_n)) / ||theta_n - theta_i^{t-1}||)
                      -- the loss improvement per unit of parameter distance, on client i's validation split
    fomo_update       theta_i <- theta_i^{t-1} + sum_n (w_n / sum_m w_m) (theta_n - theta_i^{t-1})   (sum w > 0)
                      theta_i <- theta_i^{t-1}                                                     (otherwise)
                      The normalised weights sum to 1, so the update is the convex combination
                      sum_n (w_n / sum w) theta_n of the improving candidates; it is computed in that form,
                      which is exact: one candidate with w > 0 gives that candidate bit for bit.
    epsilon_at        epsilon_t = max(0, epsilon - decay (t - 1)): the exploration rate of round t
    choose_candidates the server's epsilon-greedy choice of M models for client i over its affinity row P[i, :]
                      (each of the M slots: with probability epsilon_t the next client of a random order, else
                      the next client of highest affinity, ties broken at random; no client twice, never i)
    update_affinity   P[i, n] += w_n for each candidate n client i weighed
"""
from __future__ import annotations

from typing import List, Mapping, Sequence

import numpy as np
import torch


def fomo_weights(own_loss: float, candidate_losses: Sequence[float], distances: Sequence[float]) -> torch.Tensor:
    """w_n = max(0, (L(own) - L(theta_n)) / ||theta_n - own||) in float64; a candidate at distance 0 gets 0 (it is
    the client's own model: moving toward it changes nothing)."""
    out = torch.zeros(len(candidate_losses), dtype=torch.float64)
    for n, (loss, dist) in enumerate(zip(candidate_losses, distances)):
        if dist > 0:
            out[n] = max(0.0, (float(own_loss) - float(loss)) / float(dist))
    return out


def normalised(weights: torch.Tensor) -> torch.Tensor:
    """w_n / sum_m w_m (all zeros when no weight is positive: the client keeps its model)."""
    total = float(weights.sum())
    return weights / total if total > 0 else torch.zeros_like(weights)


def fomo_update(own: torch.Tensor, candidates: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """One state entry after the first-order update: sum_n (w_n / sum w) theta_n, or ``own`` when no w_n > 0."""
    share = normalised(weights)
    if float(share.sum()) <= 0:
        return own.clone()
    out = None
    for s, theta in zip(share.tolist(), candidates):
        if s == 0:
            continue  # a non-improving candidate contributes nothing (not even a rounding error)
        term = theta.to(own.dtype) * s if s != 1.0 else theta.to(own.dtype).clone()
        out = term if out is None else out + term
    return out


def state_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], keys: Sequence[str]) -> float:
    """||a - b||_2 over the entries ``keys`` taken as one vector (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for k in keys:
        total += (a[k].double() - b[k].double().to(a[k].device)).pow(2).sum().cpu()
    return float(total.sqrt())


def epsilon_at(epsilon: float, decay: float, rnd: int) -> float:
    """epsilon_t = max(0, epsilon - decay (t - 1)) for round t = 1, 2, ..."""
    return max(0.0, float(epsilon) - float(decay) * (int(rnd) - 1))


def choose_candidates(affinity_row: np.ndarray, pool: Sequence[int], m: int, epsilon: float,
                      rng: np.random.Generator) -> List[int]:
    """The epsilon-greedy choice of ``m`` clients out of ``pool`` (the client itself excluded by the caller).

    The draws, in this order: one random number per pool member for tie-breaking the affinity ranking, one random
    order of the pool, then one uniform number per slot (explore when it is below ``epsilon``). A slot whose pick
    is already chosen takes the next one of the same list, so no client is sent twice; with ``m`` at least the
    pool's size every pool member is chosen."""
    pool = [int(c) for c in pool]
    if m <= 0 or not pool:
        return []
    if m >= len(pool):
        return sorted(pool)
    ties = rng.random(len(pool))
    scores = np.asarray([affinity_row[c] for c in pool], dtype=np.float64)
    top = [pool[j] for j in np.lexsort((ties, scores))[::-1]]  # highest affinity first, random tie-breaking
    random_order = [pool[j] for j in rng.permutation(len(pool))]
    chosen: List[int] = []
    for _ in range(m):
        source = random_order if rng.random() < epsilon else top
        while source[0] in chosen:
            source.pop(0)
        chosen.append(source.pop(0))
    return chosen


def update_affinity(affinity: torch.Tensor, cid: int, candidates: Sequence[int], weights: torch.Tensor) -> None:
    """P[cid, n] += w_n for each weighed candidate n (in place)."""
    for n, w in zip(candidates, weights.tolist()):
        affinity[int(cid), int(n)] += float(w)
