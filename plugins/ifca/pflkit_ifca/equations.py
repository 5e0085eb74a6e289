"""IFCA's steps as small functions (Ghosh et al., NeurIPS 2020, Algorithm 1, model-averaging option)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from pflkit.core import State, fold_mean


def choose_cluster(losses: Sequence[float]) -> int:
    """Cluster identity estimation: j_hat = argmin_j F_i(theta_j) over the client's training loss of each of the
    k models (ties go to the lowest index)."""
    if not len(losses):
        raise ValueError("choose_cluster of no losses")
    return int(np.argmin(np.asarray(losses, dtype=np.float64)))


def cluster_average(models: List[State], states: Sequence[State], weights: Sequence[float],
                    clusters: Sequence[int]) -> List[State]:
    """Model averaging: theta_j <- sum_i s_ij w_i theta_i / sum_i s_ij w_i over the uploads assigned to cluster j
    (w_i = 1 in the paper, or n_i); a cluster that received no upload keeps its model. Computed with streaming
    aggregation's arithmetic (core.api.fold), so one cluster gives FedAvg's model bit for bit."""
    out = list(models)
    for j in range(len(models)):
        members = [i for i, c in enumerate(clusters) if c == j]
        if members:
            averaged = fold_mean([states[i] for i in members], [weights[i] for i in members])
            out[j] = {**models[j], **averaged}
    return out


def recovery(assignment: Dict[int, int], truth: Sequence[int]) -> Optional[float]:
    """Adjusted Rand index of the assigned clients' clusters against their true clusters (1 = recovered up to
    relabelling, ~0 = chance); None before two clients have an assignment."""
    from sklearn.metrics import adjusted_rand_score

    cids = sorted(c for c in assignment if 0 <= c < len(truth))
    if len(cids) < 2:
        return None
    return float(adjusted_rand_score([int(truth[c]) for c in cids], [int(assignment[c]) for c in cids]))
