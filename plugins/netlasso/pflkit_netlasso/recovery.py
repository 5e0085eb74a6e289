"""How well the fused clusters match a dataset's true clusters: the adjusted Rand index (scikit-learn's, as IFCA's
recovery score), against the truth the dataset's meta gives (``pflkit.datasets.clustered.client_clusters``)."""
from __future__ import annotations

import logging
from typing import Any, List, Mapping, Optional, Sequence

log = logging.getLogger(__name__)


def adjusted_rand_index(truth: Sequence[int], found: Sequence[int]) -> float:
    """ARI of two labelings of the same clients: 1 for the same partition up to renaming, about 0 for chance."""
    from sklearn.metrics import adjusted_rand_score

    if len(truth) != len(found):
        raise ValueError(f"labelings of {len(truth)} and {len(found)} clients")
    return float(adjusted_rand_score([int(t) for t in truth], [int(f) for f in found]))


def true_clusters(meta: Optional[Mapping[str, Any]], cfg: Mapping[str, Any], num_clients: int
                  ) -> Optional[List[int]]:
    """The true cluster of every client when the dataset's meta gives them for this partition (the
    ``digits_clusters`` dataset under ``partition.name=by_group``), else None (with a warning when the dataset has
    true clusters that this partition does not keep)."""
    from pflkit.core import client_clusters

    meta = meta or {}
    truth, problem = client_clusters(meta, cfg, num_clients)
    if truth is None and "true_cluster" in meta:
        log.warning("Network Lasso cluster recovery (ARI) not computed: %s", problem)
    return truth
