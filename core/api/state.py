"""State-dict helpers shared by trainers and aggregators (one implementation of each mechanic)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import nn

State = Dict[str, torch.Tensor]


def clone_state(state: Mapping[str, torch.Tensor]) -> State:
    """Detached copies of every tensor of ``state`` (on the same devices)."""
    return {k: v.detach().clone() for k, v in state.items()}


def subset(state: Mapping[str, torch.Tensor], keys: Iterable[str]) -> State:
    return {k: state[k] for k in keys}


def detached_state(model: nn.Module, keys: Optional[Iterable[str]] = None) -> State:
    """Copies of ``model``'s state tensors (all, or ``keys``): safe to send, since training will not alter them."""
    sd = model.state_dict()
    keys = sd.keys() if keys is None else keys
    return {k: sd[k].detach().clone() for k in keys}


def bn_keys(model: nn.Module, include_affine: bool = False) -> List[str]:
    """State keys belonging to batch-norm layers: running statistics, plus weight/bias if ``include_affine``."""
    out: List[str] = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase):
            prefix = f"{mod_name}." if mod_name else ""
            names = ["running_mean", "running_var", "num_batches_tracked"]
            if include_affine:
                names += ["weight", "bias"]
            out += [prefix + n for n in names if (prefix + n) in model.state_dict()]
    return out


def module_keys(model: nn.Module, prefix: str) -> List[str]:
    """State keys under a sub-module name (e.g. 'features' or 'head')."""
    return [k for k in model.state_dict() if k == prefix or k.startswith(prefix + ".")]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> State:
    """Per-key weighted mean; integer tensors (e.g. BN batch counters) take the first client's value.

    Accumulates client by client with fused multi-tensor ops (no K-fold stacked copy of the model).
    """
    if not states:
        raise ValueError("weighted_average of no states")
    total = float(sum(weights))
    w = [float(x) / total for x in weights]
    keys = list(states[0])
    float_keys = [k for k in keys if states[0][k].is_floating_point()]
    acc = torch._foreach_mul([states[0][k] for k in float_keys], w[0]) if float_keys else []
    for state, wi in zip(states[1:], w[1:]):
        if float_keys:
            torch._foreach_add_(acc, [state[k] for k in float_keys], alpha=wi)
    out: State = dict(zip(float_keys, acc))
    for k in keys:
        if k not in out:
            out[k] = states[0][k].clone()
    return {k: out[k] for k in keys}


class WeightedMean:
    """The sample-weighted mean of one reply field over the replying clients, computed before the server saw the
    replies (distributed fast path, ``ServerAggregator.mean_fields``): every accepted reply holds this same object
    in place of its own value. ``state``: the mean, as ``weighted_average`` returns it; ``weight``: the sum of the
    weights (``num_samples``)."""

    __slots__ = ("state", "weight")

    def __init__(self, state: State, weight: float) -> None:
        self.state, self.weight = state, weight


def load_into(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (any subset of keys) into ``model`` in place, without touching the other keys."""
    own = model.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def flatten(state: Mapping[str, torch.Tensor], keys: Optional[Iterable[str]] = None) -> torch.Tensor:
    keys = list(state) if keys is None else list(keys)
    return torch.cat([state[k].reshape(-1).float() for k in keys]) if keys else torch.zeros(0)


def proximal_term(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||params - anchors||^2`` summed over all tensors, differentiable w.r.t. ``params`` (FedProx, Ditto, ...).

    Uses torch's multi-tensor (``_foreach``) kernels: one fused launch per op instead of a Python loop per
    parameter tensor. ``anchors`` must be detached.
    """
    if not params:
        return torch.zeros(())
    params, anchors = list(params), list(anchors)
    if any(_transformed(p) for p in params + anchors):  # inside vmap/grad (clients.batched): no foreach rule there
        norms = [torch.linalg.vector_norm(p - a) for p, a in zip(params, anchors)]
    else:
        norms = torch._foreach_norm(torch._foreach_sub(params, anchors))
    return torch.stack(norms).square().sum()


def _transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor seen inside a torch.func transform (vmap, grad)."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False
