"""Built-in partitioners: IID, Dirichlet label skew, pathological (n classes per client).

Every partitioner is a function ``(labels, num_clients, rng, groups=None, **params) -> list of index arrays``
returning a true partition (no sample on two clients) and declares its ``params`` for config validation.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from pflkit.core.errors import DataError
from pflkit.core.params import Param, positive


def _check_enough(n: int, num_clients: int, min_size: int) -> None:
    if n < num_clients * min_size:
        raise DataError(f"cannot give {num_clients} clients at least {min_size} samples each from {n} samples")


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None) -> List[np.ndarray]:
    """Uniformly random, equal-sized shards (sizes differ by at most one)."""
    _check_enough(len(labels), num_clients, 1)
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


iid.params = {}


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None, alpha: float = 0.1,
              min_size: int = 10) -> List[np.ndarray]:
    """Label skew: each class is split across clients with proportions ~ Dir(alpha).

    Minimum size guarantee without unbounded resampling: proportions are drawn once per class, then clients
    below ``min_size`` take samples from the largest clients (from the classes those hold most of), which
    always terminates and keeps the partition exact.
    """
    n = len(labels)
    _check_enough(n, num_clients, min_size)
    owner = np.empty(n, dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
        for client, part in enumerate(np.split(idx, cuts)):
            owner[part] = client
    counts = np.bincount(owner, minlength=num_clients)
    for client in np.flatnonzero(counts < min_size):
        while counts[client] < min_size:
            donor = int(np.argmax(counts))
            donor_idx = np.flatnonzero(owner == donor)
            need = min(min_size - counts[client], counts[donor] - min_size)
            if need <= 0:  # cannot happen given the size check, kept as a guard against infinite loops
                raise DataError("dirichlet partition cannot satisfy min_size")
            # take the donor's samples of the class it holds most of, so the skew is preserved
            donor_labels = labels[donor_idx]
            order = np.argsort(-np.bincount(donor_labels)[donor_labels], kind="stable")
            moved = donor_idx[order[:need]]
            owner[moved] = client
            counts[donor] -= len(moved)
            counts[client] += len(moved)
    return [np.flatnonzero(owner == k) for k in range(num_clients)]


dirichlet.params = {
    "alpha": Param(0.1, "Dirichlet concentration (smaller = more skew)", check=positive),
    "min_size": Param(10, "minimum samples per client (guaranteed)", check=lambda v: None if v >= 1 else "must be >= 1"),
}


def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None,
                 classes_per_client: int = 2, balance: bool = True) -> List[np.ndarray]:
    """Each client holds ``classes_per_client`` classes; each class is divided among the clients holding it.

    Classes are dealt round-robin over a shuffled class order, so every class is used and every client gets
    exactly ``classes_per_client`` distinct classes (when there are at least that many classes).
    """
    classes = np.unique(labels)
    if classes_per_client > len(classes):
        raise DataError(f"classes_per_client={classes_per_client} exceeds the {len(classes)} classes available")
    order = rng.permutation(classes)
    holders = {int(c): [] for c in classes}
    slot = 0
    for client in range(num_clients):
        for _ in range(classes_per_client):
            holders[int(order[slot % len(order)])].append(client)
            slot += 1
    parts: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        if not owners:
            continue
        if balance:
            chunks = np.array_split(idx, len(owners))
        else:
            props = rng.uniform(0.5, 1.5, len(owners))
            cuts = (np.cumsum(props / props.sum())[:-1] * len(idx)).astype(int)
            chunks = np.split(idx, cuts)
        for client, chunk in zip(owners, chunks):
            parts[client].append(chunk)
    out = [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise DataError(f"pathological partition left clients {empty} empty: too few samples per class")
    return out


pathological.params = {
    "classes_per_client": Param(2, "distinct classes per client", check=positive),
    "balance": Param(True, "split each class equally among its holders (else random sizes)"),
}
