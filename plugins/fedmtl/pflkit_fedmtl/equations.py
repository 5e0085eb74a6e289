"""Fed-MTL's objective and its task-relationship matrix as small functions.

Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017, Eq. (1), Sec. 3.1: with
W = [w_1 .. w_m] (one column per client, d x m),

    min_{W, Omega}  sum_t sum_i l_t(w_t; x_t^i, y_t^i) + R(W, Omega),
    R(W, Omega) = lam tr(W Omega W^T) + lam_fro ||W||_F^2           (the paper's example of R)

Omega is learned by alternating minimisation: W for fixed Omega, then the closed form of the task-relationship
formulation the paper takes it from (Zhang & Yeung, 2010), which is what the authors' code runs:

    Sigma = (W^T W)^{1/2} / tr((W^T W)^{1/2}),   Omega = Sigma^{-1},   starting from Sigma = I / m (Omega = m I)
    (eigenvalues of W^T W below 1e-7 are raised to 1e-7 first, as in the authors' code, so Sigma is invertible)

At that point tr(W Omega W^T) = ||W||_*^2 (the squared trace norm). The fixed alternatives:

    omega_mean   I - 11^T / m          tr(W Omega W^T) = sum_k ||w_k - w_bar||^2  (mean-regularised MTL)
    omega_code   (1 - 1/m)^2 11^T      what LG-FedAvg's and FedRep's main_mtl.py compute: (I - 11^T/m)**2 taken
                                        elementwise on an all-ones I, i.e. tr(W Omega W^T) = (1 - 1/m)^2 ||sum_k w_k||^2

Client i minimises its own part of the objective with the other columns fixed. Since Omega is symmetric,
tr(W Omega W^T) = Omega_ii ||w_i||^2 + 2 <w_i, b_i> + (terms without w_i), b_i = sum_{j != i} Omega_ij w_j, so

    client_regulariser   lam (Omega_ii ||w_i||^2 + 2 <w_i, b_i>) + lam_fro ||w_i||^2

has exactly the gradient of R with respect to w_i: 2 lam (W Omega)_i + 2 lam_fro w_i. It is built from the live
parameters, so it has a gradient (a regulariser built from ``state_dict()`` tensors, which are detached, has none).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Sequence, Tuple

import torch

EIGEN_FLOOR = 1e-7  # the authors' code raises eigenvalues of W^T W below this before the square root


def omega_initial(m: int) -> torch.Tensor:
    """Omega = Sigma^{-1} with Sigma = I / m (the authors' code's start): m I."""
    return torch.eye(m, dtype=torch.float64) * m


def omega_mean(m: int) -> torch.Tensor:
    """I - 11^T / m: tr(W Omega W^T) = sum_k ||w_k - w_bar||^2."""
    return torch.eye(m, dtype=torch.float64) - torch.full((m, m), 1.0 / m, dtype=torch.float64)


def omega_code(m: int) -> torch.Tensor:
    """(1 - 1/m)^2 11^T: the constant matrix LG-FedAvg's and FedRep's code build."""
    return torch.full((m, m), (1.0 - 1.0 / m) ** 2, dtype=torch.float64)


def sigma_and_omega(gram: torch.Tensor, floor: float = EIGEN_FLOOR) -> Tuple[torch.Tensor, torch.Tensor]:
    """The closed-form update from the Gram matrix W^T W (m x m): Sigma = sqrt(W^T W) / tr(sqrt(W^T W)) and
    Omega = Sigma^{-1}, both through one symmetric eigendecomposition (float64)."""
    g = gram.to(torch.float64)
    g = (g + g.T) / 2
    vals, vecs = torch.linalg.eigh(g)
    vals = vals.clamp(min=floor)
    root = vals.sqrt()
    trace = float(root.sum())
    sigma = (vecs * (root / trace)) @ vecs.T
    omega = (vecs * (trace / root)) @ vecs.T
    return (sigma + sigma.T) / 2, (omega + omega.T) / 2


def gram(models: Sequence[Mapping[str, torch.Tensor]], keys: Sequence[str]) -> torch.Tensor:
    """W^T W: G_jk = <w_j, w_k> over the entries ``keys`` (float64), one key at a time."""
    m = len(models)
    out = torch.zeros(m, m, dtype=torch.float64)
    for k in keys:
        block = torch.stack([mod[k].reshape(-1).to(torch.float64).cpu() for mod in models])  # m x numel
        out += block @ block.T
    return out


def neighbour_sums(rows: Mapping[int, Sequence[float]], models: Iterable[Tuple[int, Mapping[str, torch.Tensor]]],
                   keys: Sequence[str]) -> Dict[int, Dict[str, torch.Tensor]]:
    """b_i = sum_{j != i} Omega_ij w_j for each client i of ``rows`` (i -> row i of Omega), in one pass over
    ``models`` ((j, w_j) in ascending j, each read once). The server and a client that computes its own b_i run
    this same code in the same order, so both give the same bits."""
    out: Dict[int, Dict[str, torch.Tensor]] = {int(i): {} for i in rows}
    for j, w in models:
        for i, acc in out.items():
            if int(j) == i:
                continue
            coef = float(rows[i][int(j)])
            for k in keys:
                term = w[k].to(torch.float32) * coef
                acc[k] = term if k not in acc else acc[k] + term
    return out


def client_regulariser(params: Mapping[str, torch.Tensor], omega_ii: float, neighbours: Mapping[str, torch.Tensor],
                       lam: float, lam_fro: float) -> torch.Tensor:
    """lam (Omega_ii ||w_i||^2 + 2 <w_i, b_i>) + lam_fro ||w_i||^2 over the entries of ``params`` (live tensors)."""
    sq = sum((p * p).sum() for p in params.values())
    total = (lam_fro + lam * float(omega_ii)) * sq
    if lam and neighbours:
        total = total + 2.0 * lam * sum((p * neighbours[k]).sum() for k, p in params.items())
    return total


def trace_regulariser(w: torch.Tensor, omega: torch.Tensor, lam: float, lam_fro: float) -> torch.Tensor:
    """The full R(W, Omega) = lam tr(W Omega W^T) + lam_fro ||W||_F^2 for a d x m matrix W (tests, logging)."""
    return lam * torch.trace(w @ omega.to(w.dtype) @ w.T) + lam_fro * (w * w).sum()


def auto_lambda(num_params: int) -> float:
    """c = 10^-f, f = floor(log10 d) + 2: the weight LG-FedAvg's and FedRep's main_mtl.py give both terms."""
    return 10.0 ** -(math.floor(math.log10(max(1, num_params))) + 2)
