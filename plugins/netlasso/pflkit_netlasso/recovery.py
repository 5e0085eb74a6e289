"""How well the fused clusters match a dataset's true clusters: the adjusted Rand index (Hubert and Arabie, 1985),
the score IFCA's and Network Lasso's cluster recovery are reported with."""
from __future__ import annotations

from collections import Counter
from typing import Any, List, Mapping, Optional, Sequence


def _pairs(n: int) -> float:
    return n * (n - 1) / 2.0


def adjusted_rand_index(truth: Sequence[int], found: Sequence[int]) -> float:
    """ARI of two labelings of the same items: 1 for the same partition (up to renaming), about 0 for a random
    one. Two trivial partitions that agree (one cluster each, or all singletons) score 1."""
    if len(truth) != len(found):
        raise ValueError(f"labelings of {len(truth)} and {len(found)} items")
    n = len(truth)
    joint = Counter(zip(truth, found))
    index = sum(_pairs(c) for c in joint.values())
    rows = sum(_pairs(c) for c in Counter(truth).values())
    cols = sum(_pairs(c) for c in Counter(found).values())
    total = _pairs(n)
    expected = rows * cols / total if total else 0.0
    maximum = (rows + cols) / 2.0
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)


def true_clusters(meta: Optional[Mapping[str, Any]], cfg: Mapping[str, Any], num_clients: int
                  ) -> Optional[List[int]]:
    """The true cluster of every client when the dataset's meta gives them for this partition (the ``clustered``
    dataset under ``partition.name=by_group``), else None."""
    from pflkit.datasets.clustered import client_clusters

    truth, _why = client_clusters(meta or {}, cfg, num_clients)
    return truth
