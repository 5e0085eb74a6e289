"""FedPHP's equations as small pure functions.

Li, Zhan, Shao, Li, Song: "FedPHP: Federated Personalization with Inherited Private Models", ECML-PKDD 2021.
Equation numbers are not cited: this was written without a copy of the paper at hand; every formula below follows
the authors' code (github.com/lxcnju/FedRepo, ``algorithms/fedphp.py`` and ``tools.mmd_rbf_noaccelerate``).

* local objective:  L = (1 - lambda) * CE(q, y) + lambda * KT                          (``local_objective``)
* knowledge transfer, KD:  KT = mean_b[ -sum_c softmax(q_hpm / T)_c * log softmax(q)_c ]  (temperature on the
  teacher only, T = 4 in the authors' code)                                           (``kd_transfer``)
* knowledge transfer, MMD: the multi-kernel RBF MMD^2 between the local and the HPM features (``mmd_rbf``)
* the HPM's momentum:  mu_i = min(0.9, 0.9 * n_i / max(1, floor(c_ratio * T)))  with n_i the client's number of
  earlier participations, c_ratio the join ratio and T the number of rounds          (``hpm_momentum``)
* the HPM's update, over all state keys:  HPM <- mu_i * HPM + (1 - mu_i) * w_local   (``hpm_update``)
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F


def local_objective(ce: torch.Tensor, transfer: torch.Tensor, lam: float) -> torch.Tensor:
    """(1 - lambda) * CE + lambda * KT."""
    return (1.0 - lam) * ce + lam * transfer


def kd_transfer(logits: torch.Tensor, hpm_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Batch mean of -sum_c softmax(q_hpm / T) log softmax(q); the HPM's logits get no gradient."""
    target = (hpm_logits.detach() / temperature).softmax(dim=1)
    return -(target * logits.log_softmax(dim=1)).sum(dim=1).mean()


def mmd_rbf(source: torch.Tensor, target: torch.Tensor, kernel_mul: float = 2.0, kernel_num: int = 5) -> torch.Tensor:
    """Squared MMD between two equally sized batches with a sum of ``kernel_num`` Gaussian kernels whose bandwidths
    are the mean pairwise squared distance (no gradient) times kernel_mul^(i - kernel_num // 2), i = 0..kernel_num-1
    (the authors' ``mmd_rbf_noaccelerate``); the mean of K_ss + K_tt - K_st - K_ts."""
    n = source.shape[0]
    total = torch.cat([source.reshape(n, -1), target.reshape(target.shape[0], -1)], dim=0)
    m = total.shape[0]
    distances = ((total.unsqueeze(0) - total.unsqueeze(1)) ** 2).sum(dim=2)
    bandwidth = distances.detach().sum() / (m * m - m)
    bandwidth = bandwidth / (kernel_mul ** (kernel_num // 2))
    kernels = sum(torch.exp(-distances / (bandwidth * kernel_mul ** i)) for i in range(kernel_num))
    xx, yy = kernels[:n, :n], kernels[n:, n:]
    xy, yx = kernels[:n, n:], kernels[n:, :n]
    return torch.mean(xx + yy - xy - yx)


def hpm_momentum(participations: int, expected_participations: int, mu_max: float = 0.9) -> float:
    """mu_i = min(mu_max, mu_max * n_i / max(1, expected)): 0 at a client's first participation, growing linearly
    to mu_max when it has taken part as often as an average client does in the whole run."""
    return min(max(mu_max * participations / max(1, int(expected_participations)), 0.0), mu_max)


def hpm_update(hpm: Dict[str, torch.Tensor], local: Dict[str, torch.Tensor], mu: float) -> Dict[str, torch.Tensor]:
    """mu * HPM + (1 - mu) * w_local per key; integer tensors (BatchNorm's batch counters) take the local value."""
    return {k: (mu * v + (1.0 - mu) * local[k]) if v.is_floating_point() else local[k].clone()
            for k, v in hpm.items()}
