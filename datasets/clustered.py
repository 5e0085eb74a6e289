"""An embedded dataset with a TRUE cluster structure: the bundled 8x8 digits, dealt to k clusters of clients,
each cluster with its own input-to-label relation, so that clustered FL (IFCA) can be scored on how well it
recovers the clusters (adjusted Rand index against the truth).

Built deterministically from scikit-learn's 1,797 8x8 handwritten digits (standardised as the ``digits``
dataset). The digits are dealt to ``num_clusters`` clusters (stratified by class; every cluster gets different
handwritten digits), each cluster's digits to ``clients_per_cluster`` groups (again stratified), and cluster c
changes its samples by ``structure``:

==================  =====================================================================================
structure           cluster c
==================  =====================================================================================
label_rotation      label y becomes (y + c) mod 10: the same images, every label moved (cluster 0 unchanged)
label_permutation   label y becomes pi_c(y), a seeded random permutation of the 10 labels (cluster 0: identity)
image_rotation      the image is turned by c x 90 degrees, labels unchanged (IFCA's rotated MNIST; k <= 4)
==================  =====================================================================================

Under the label structures no single model fits two clusters (the same image has different labels), so a
global model (FedAvg) is poor and a method that finds the clusters is not; under ``image_rotation`` one model can
fit all clusters, only less easily.

Group ``g = c * clients_per_cluster + j`` is client ``g`` under ``partition.name = by_group`` (its default
``assign = exact``, ``shuffle = false``): set ``partition.num_clients = num_clients x clients_per_cluster``. The
loader's ``meta`` holds the true cluster of every group (``true_cluster``) and the label maps; the server sees it
as ``ServerContext.data_info["meta"]`` -- for *evaluating* an algorithm (cluster recovery), never for training it.
:func:`client_clusters` turns it into the true cluster of every client when the partition keeps groups and
clients aligned. The dealing and the permutations are seeded by ``dataset.seed`` alone (not the run seed).
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

import numpy as np
import torch

from pflkit.core.data.data import DatasetBundle
from pflkit.core.common.errors import DataError
from pflkit.core.api.params import Param, positive
from pflkit.core.api.task import classification

from .feature_shift import _stratified_deal

STRUCTURES = {
    "label_rotation": "cluster c relabels y as (y + c) mod 10",
    "label_permutation": "cluster c relabels y by a seeded random permutation (cluster 0: identity)",
    "image_rotation": "cluster c turns its images by c x 90 degrees (IFCA's rotated MNIST; at most 4 clusters)",
}
NUM_CLASSES = 10


def label_maps(structure: str, num_clusters: int, seed: int = 0) -> List[List[int]]:
    """Cluster c's label map as a list: new label = maps[c][old label] (the identity for image_rotation)."""
    identity = list(range(NUM_CLASSES))
    if structure == "label_rotation":
        return [[(y + c) % NUM_CLASSES for y in identity] for c in range(num_clusters)]
    if structure == "label_permutation":
        rng = np.random.default_rng([int(seed), 1])  # a stream of its own: the dealing below uses seed alone
        maps = [identity]
        while len(maps) < num_clusters:
            perm = [int(v) for v in rng.permutation(NUM_CLASSES)]
            if perm not in maps:  # two clusters with one relation would not be two clusters
                maps.append(perm)
        return maps
    return [identity for _ in range(num_clusters)]


def group_names(num_clusters: int = 4, clients_per_cluster: int = 5, **_ignored) -> List[str]:
    """Group (= by_group client) names for these options, computed without building the data."""
    return [f"cluster{c}-{j + 1}" for c in range(num_clusters) for j in range(clients_per_cluster)]


def load_digits_clusters(root: Optional[str] = None, download: bool = False, num_clusters: int = 4,
                         clients_per_cluster: int = 5, structure: str = "label_rotation",
                         seed: int = 0) -> DatasetBundle:
    """Embedded digits in k clusters of clients, each cluster with its own label map or image rotation.

    The true cluster of every group (by_group client) is in ``meta["true_cluster"]`` (for evaluation only)."""
    from sklearn.datasets import load_digits as _load

    if structure not in STRUCTURES:
        raise DataError(f"dataset.structure: unknown '{structure}'; choose from {', '.join(STRUCTURES)}")
    if num_clusters < 1 or clients_per_cluster < 1:
        raise DataError("dataset.num_clusters and dataset.clients_per_cluster must be >= 1")
    if structure == "image_rotation" and num_clusters > 4:
        raise DataError(f"dataset.num_clusters: image_rotation has 4 distinct rotations, not {num_clusters}")
    if structure == "label_permutation" and num_clusters > 24:  # far below 10!, and plenty for any study
        raise DataError(f"dataset.num_clusters: {num_clusters} is above label_permutation's 24")
    data = _load()
    labels = data.target.astype(np.int64)
    groups_total = num_clusters * clients_per_cluster
    if 2 * groups_total > len(labels):
        raise DataError(f"dataset: {groups_total} groups cannot be cut from {len(labels)} digits "
                        f"(each client needs at least 2)")
    rng = np.random.default_rng(int(seed))
    cluster = _stratified_deal(labels, num_clusters, rng)
    x = torch.as_tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4  # the digits dataset's standard scaling
    y = torch.as_tensor(labels)
    group = torch.empty(len(labels), dtype=torch.long)
    maps = label_maps(structure, num_clusters, seed)
    for c in range(num_clusters):
        idx = np.flatnonzero(cluster == c)
        sub = _stratified_deal(labels[idx], clients_per_cluster, rng)
        t = torch.as_tensor(idx)
        group[t] = torch.as_tensor(c * clients_per_cluster + sub)
        y[t] = torch.as_tensor(maps[c])[y[t]]
        if structure == "image_rotation" and c:
            x[t] = torch.rot90(x[t], k=c, dims=(2, 3))
    true_cluster = [g // clients_per_cluster for g in range(groups_total)]
    return DatasetBundle(
        x=x.contiguous(), y=y, task=classification(NUM_CLASSES), input_shape=(1, 8, 8), groups=group,
        group_names=group_names(num_clusters, clients_per_cluster),
        class_names=[str(i) for i in range(NUM_CLASSES)],
        meta={"source": "sklearn.datasets.load_digits dealt to clusters with their own label maps",
              "structure": structure, "num_clusters": num_clusters, "clients_per_cluster": clients_per_cluster,
              "true_cluster": true_cluster, "label_maps": maps})


load_digits_clusters.params = {
    "num_clusters": Param(4, "number of true clusters k (IFCA's experiments use 2-4)", check=positive),
    "clients_per_cluster": Param(5, "groups (by_group clients) per cluster; set partition.num_clients = "
                                    "num_clusters x clients_per_cluster", check=positive),
    "structure": Param("label_rotation", "what differs between clusters: " +
                       "; ".join(f"{k} = {v}" for k, v in STRUCTURES.items()), choices=tuple(STRUCTURES)),
    "seed": Param(0, "seed of dealing digits to clusters and groups and of label_permutation's permutations"),
}
#: data-free hook: group names (= client names under by_group) for given dataset options
load_digits_clusters.group_names = group_names


def client_clusters(meta: Mapping[str, Any], cfg: Mapping[str, Any],
                    num_clients: int) -> Tuple[Optional[List[int]], Optional[str]]:
    """The true cluster of every client (client k = group k), or None and why it is not known.

    It is known when the dataset's ``meta`` has ``true_cluster`` (one entry per group) and the partition maps group
    k to client k: ``by_group`` with ``assign`` exact (or auto with as many groups as clients) and no shuffle.
    """
    truth = meta.get("true_cluster") if isinstance(meta, Mapping) else None
    if truth is None:
        return None, "the dataset gives no true clusters (meta['true_cluster'])"
    part = cfg.get("partition", {}) if isinstance(cfg, Mapping) else {}
    if part.get("name") != "by_group" or part.get("shuffle", False) or \
            part.get("assign", "exact") not in ("exact", "auto"):
        return None, ("the true clusters are per group, and only partition.name=by_group with assign=exact and "
                      "shuffle=false makes client k group k")
    if len(truth) != num_clients:
        return None, f"the dataset has {len(truth)} groups but the run {num_clients} clients"
    return [int(c) for c in truth], None
