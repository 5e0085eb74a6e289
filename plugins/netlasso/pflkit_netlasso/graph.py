"""The client graph of Network Lasso: which pairs of clients are coupled (the edges E of Eq. 1) and how strongly
(w_jk). Edges are (j, k, w_jk) with j < k, in ascending order."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

Edge = Tuple[int, int, float]


def complete_graph(num_nodes: int) -> List[Edge]:
    """Every pair of clients, unit weights (the plugin's default: no side information says who is close)."""
    return [(j, k, 1.0) for j in range(num_nodes) for k in range(j + 1, num_nodes)]


def knn_graph(xs: Sequence[torch.Tensor], k: int) -> List[Edge]:
    """Each client linked to its ``k`` nearest other clients by the Euclidean distance of their models ``xs``
    (ties: the smaller client id), the union of those choices (an edge when either end chose the other), unit
    weights."""
    n = len(xs)
    k = min(int(k), n - 1)
    pairs = set()
    stacked = torch.stack([x.reshape(-1).double() for x in xs]) if n else torch.zeros(0, 0)
    dist = torch.cdist(stacked, stacked) if n else stacked
    for i in range(n):
        order = sorted((float(dist[i, j]), j) for j in range(n) if j != i)
        for _, j in order[:k]:
            pairs.add((min(i, j), max(i, j)))
    return [(j, kk, 1.0) for j, kk in sorted(pairs)]


def degrees(num_nodes: int, edges: Sequence[Edge]) -> List[int]:
    deg = [0] * num_nodes
    for j, k, _ in edges:
        deg[j] += 1
        deg[k] += 1
    return deg


def out_edges(num_nodes: int, edges: Sequence[Edge]) -> Dict[int, List[Tuple[int, float]]]:
    """Client j -> the edges (k, w_jk) with k > j: the edges whose dual the server keeps in j's entry."""
    out: Dict[int, List[Tuple[int, float]]] = {j: [] for j in range(num_nodes)}
    for j, k, w in edges:
        out[j].append((k, w))
    return out
