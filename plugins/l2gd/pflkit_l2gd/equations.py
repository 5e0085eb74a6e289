"""L2GD's steps as small functions (Hanzely, Richtarik: "Federated Learning of a Mixture of Global and Local
Models", 2020, Algorithm 1 on F(x) = f(x) + lambda psi(x), f(x) = (1/n) sum_i f_i(x_i),
psi(x) = (1/2n) sum_i ||x_i - x_bar||^2).

G(x) = grad f(x) / (1 - p) with probability 1 - p, lambda grad psi(x) / p with probability p; x <- x - alpha G(x).
Since d f / d x_i = grad f_i(x_i) / n and d psi / d x_i = (x_i - x_bar) / n, per client:

    local step      x_i <- x_i - alpha / (n (1 - p)) grad f_i(x_i)
    averaging step  x_i <- (1 - c) x_i + c x_bar,   c = alpha lambda / (n p)
"""
from __future__ import annotations

from typing import Dict

import torch


def local_step_size(alpha: float, n: int, p: float) -> float:
    """alpha / (n (1 - p)): the step size of a local gradient step on f_i."""
    return alpha / (n * (1.0 - p))


def averaging_coefficient(alpha: float, lam: float, n: int, p: float) -> float:
    """c = alpha lambda / (n p): how far an averaging step moves x_i toward x_bar."""
    return alpha * lam / (n * p)


def repeated_coefficient(c: float, steps: int) -> float:
    """k consecutive averaging steps leave x_bar unchanged, so they equal one step of 1 - (1 - c)^k."""
    return 1.0 - (1.0 - c) ** steps


def script_mean(mean: Dict[str, torch.Tensor], first: Dict[str, torch.Tensor], n: int) -> Dict[str, torch.Tensor]:
    """FedRep's main_l2gd.py "average": (x_first + sum_i x_i) / n = mean + x_first / n, the round's first client
    counted twice (floating-point entries; others as in ``mean``)."""
    return {k: (v + first[k] / n) if v.is_floating_point() else v for k, v in mean.items()}


def pull_toward(x: Dict[str, torch.Tensor], mean: Dict[str, torch.Tensor], coef: float) -> Dict[str, torch.Tensor]:
    """(1 - coef) x + coef x_bar for the floating-point entries of ``x`` (integer buffers such as BN batch
    counters are not parameters of the problem and stay as they are)."""
    return {k: (v + coef * (mean[k] - v)) if v.is_floating_point() and k in mean else v for k, v in x.items()}
