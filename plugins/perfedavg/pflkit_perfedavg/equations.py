"""Per-FedAvg's update as small functions on lists of tensors (one per parameter tensor), tested on hand-made
quadratics where every quantity has a closed form.

Fallah, Mokhtari, Ozdaglar (NeurIPS 2020) minimise the MAML objective F(w) = 1/n sum_i f_i(w - alpha grad f_i(w)),
whose local gradient is (I - alpha H_i(w)) grad f_i(w - alpha grad f_i(w)). Each local step estimates it from
three independent batches D, D', D'' and takes w <- w - beta * estimate:

* inner step:            w~ = w - alpha grad f(w; D)
* first-order (FO):      estimate = grad f(w~; D')                          (the Hessian term dropped)
* Hessian-free (HF):     estimate = grad f(w~; D') - alpha H(w; D'') grad f(w~; D'),
                         with H v ~ [grad f(w + delta v; D'') - grad f(w - delta v; D'')] / (2 delta)
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch

Tensors = List[torch.Tensor]


def inner_step(w: Sequence[torch.Tensor], grad: Sequence[torch.Tensor], alpha: float) -> Tensors:
    """w~ = w - alpha * grad f(w; D): the personalised model of the MAML objective after one step."""
    return [wi - alpha * gi for wi, gi in zip(w, grad)]


def hessian_vector_product(grad_at: Callable[[Tensors], Tensors], w: Sequence[torch.Tensor],
                           v: Sequence[torch.Tensor], delta: float) -> Tensors:
    """H(w) v by central differences of gradients: [grad(w + delta v) - grad(w - delta v)] / (2 delta).
    ``grad_at(point)`` returns the gradient of f(.; D'') at ``point``; exact for a quadratic f."""
    plus = grad_at([wi + delta * vi for wi, vi in zip(w, v)])
    minus = grad_at([wi - delta * vi for wi, vi in zip(w, v)])
    return [(p - m) / (2 * delta) for p, m in zip(plus, minus)]


def hf_direction(outer_grad: Sequence[torch.Tensor], hv: Sequence[torch.Tensor], alpha: float) -> Tensors:
    """The Hessian-free estimate of the MAML gradient: grad f(w~; D') - alpha * H(w; D'') grad f(w~; D')."""
    return [g - alpha * h for g, h in zip(outer_grad, hv)]


def meta_step(w: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], beta: float) -> Tensors:
    """w <- w - beta * direction (the trainer applies it through the configured optimiser, plain SGD by default)."""
    return [wi - beta * di for wi, di in zip(w, direction)]
