"""Network Lasso's ADMM as small functions on flat parameter vectors.

Hallac, Leskovec, Boyd, "Network Lasso: Clustering and Optimization in Large Graphs", KDD 2015. The problem
(Eq. 1) over a graph G = (V, E) with one model x_i per node (client):

    minimize  sum_i f_i(x_i) + lambda sum_{(j,k) in E} w_jk ||x_j - x_k||_2

Sec. 3.1 gives each edge (j,k) two copies z_jk (of x_j) and z_kj (of x_k) with the constraints x_j = z_jk,
x_k = z_kj, and scaled duals u_jk, u_kj. ADMM then alternates, with penalty rho:

    x-update   x_i <- argmin_x f_i(x) + (rho/2) sum_{k in N(i)} ||x - z_ik + u_ik||^2    (client; ``prox_center``)
    z-update   (z_jk, z_kj) <- argmin lambda w_jk ||z_jk - z_kj|| + (rho/2)(||x_j - z_jk + u_jk||^2
                                                                + ||x_k - z_kj + u_kj||^2)  (server; ``z_update``)
    u-update   u_jk <- u_jk + x_j - z_jk,   u_kj <- u_kj + x_k - z_kj                        (server; ``u_update``)

and Sec. 3.2 solves the z-update in closed form (a group soft-threshold of the difference): with a = x_j + u_jk,
b = x_k + u_kj,

    theta = max(1 - lambda w_jk / (rho ||a - b||_2), 1/2)
    z_jk = theta a + (1 - theta) b,    z_kj = (1 - theta) a + theta b.

theta = 1/2 makes z_jk = z_kj: the edge is *fused* (||a - b|| <= 2 lambda w_jk / rho). Since the z-update keeps
z_jk + z_kj = a + b, the u-update keeps u_jk + u_kj = 0 whenever it held before (it does at u = 0): one dual per
edge determines both (``u_kj = -u_jk``), which is how the server stores them.

The x-update's proximal sum is one proximal term around the mean of its centres (``prox_center``):
sum_k (rho/2) ||x - c_k||^2 = (rho d_i / 2) ||x - mean_k c_k||^2 + const, with c_k = z_ik - u_ik and d_i = |N(i)|,
so a client receives one vector and the weight rho d_i, not d_i vectors.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch


def z_update(a: torch.Tensor, b: torch.Tensor, threshold: float) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """Sec. 3.2's closed-form z-update of one edge: ``a = x_j + u_jk``, ``b = x_k + u_kj``, ``threshold =
    lambda w_jk / rho``. Returns (z_jk, z_kj, theta); theta = 1/2 means the edge is fused (z_jk = z_kj)."""
    dist = float(torch.linalg.vector_norm(a - b))
    if threshold <= 0.0:  # no penalty on this edge: z = (a, b) exactly (theta 1), also when a = b
        theta = 1.0
    elif dist <= 2.0 * threshold:  # 1 - t/dist <= 1/2 (a = b included, where t/dist is undefined)
        theta = 0.5
    else:
        theta = 1.0 - threshold / dist
    if theta == 1.0:
        return a.clone(), b.clone(), theta
    z_jk = theta * a + (1.0 - theta) * b
    z_kj = (1.0 - theta) * a + theta * b
    return z_jk, z_kj, theta


def u_update(a: torch.Tensor, b: torch.Tensor, z_jk: torch.Tensor, z_kj: torch.Tensor
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sec. 3.1's u-update of one edge, u + x - z for both ends, written with a = x_j + u_jk and b = x_k + u_kj:
    (a - z_jk, b - z_kj). Their sum is 0 (the z-update keeps z_jk + z_kj = a + b)."""
    return a - z_jk, b - z_kj


def prox_center(centres: Iterable[torch.Tensor]) -> Tuple[Optional[torch.Tensor], int]:
    """The mean of the x-update's centres c_k = z_ik - u_ik and their number d_i (Sec. 3.1's x-update as one
    proximal term, see the module docstring). The mean is a running one, m += (c - m) / n, so d equal centres
    give exactly that centre (a plain sum / d would round). (None, 0) for no centres."""
    mean: Optional[torch.Tensor] = None
    n = 0
    for c in centres:
        n += 1
        mean = c.clone() if mean is None else mean + (c - mean) / n
    return mean, n


def running_mean_step(mean: Optional[torch.Tensor], count: int, c: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """One step of ``prox_center``'s running mean (the server visits a client's edges one at a time)."""
    count += 1
    return (c.clone() if mean is None else mean + (c - mean) / count), count


def edge_step(x_j: torch.Tensor, x_k: torch.Tensor, u_jk: torch.Tensor, threshold: float
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float, float]:
    """The server's whole step on edge (j,k) (z-update, then u-update), with u_kj = -u_jk. Returns the new u_jk,
    the x-update centres c_jk = z_jk - u_jk and c_kj = z_kj - u_kj for the next round, theta, ||z_jk - z_kj|| and
    ||a - b|| (what the soft-threshold compared with 2 lambda w_jk / rho)."""
    a = x_j + u_jk
    b = x_k - u_jk
    z_jk, z_kj, theta = z_update(a, b, threshold)
    new_u_jk, new_u_kj = u_update(a, b, z_jk, z_kj)
    dist = float(torch.linalg.vector_norm(a - b))
    gap = abs(2.0 * theta - 1.0) * dist  # ||z_jk - z_kj||
    return new_u_jk, z_jk - new_u_jk, z_kj - new_u_kj, theta, gap, dist


def objective_penalty(xs: Sequence[torch.Tensor], edges: Sequence[Tuple[int, int, float]], lam: float) -> float:
    """Eq. 1's graph term lambda sum w_jk ||x_j - x_k||_2 (for reports and tests)."""
    return float(lam) * sum(float(w) * float(torch.linalg.vector_norm(xs[j] - xs[k])) for j, k, w in edges)


def fused_components(num_nodes: int, fused_edges: Iterable[Tuple[int, int]]) -> List[int]:
    """Cluster label of every node: the connected components of the fused edges (union-find), numbered in order
    of their smallest node."""
    parent = list(range(num_nodes))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for j, k in fused_edges:
        rj, rk = find(j), find(k)
        if rj != rk:
            parent[max(rj, rk)] = min(rj, rk)
    labels, out = {}, []
    for i in range(num_nodes):
        out.append(labels.setdefault(find(i), len(labels)))
    return out
