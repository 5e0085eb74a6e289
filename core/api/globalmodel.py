"""The global model's evaluation, client side: the message the core sends and the plain evaluation that answers it.

An aggregator names its global model (``ServerAggregator.global_model``: a state holding every key of the model's
``state_dict``, or None); at each evaluation the core sends every client a ``GLOBAL_EVALUATE`` message with that
state and the client answers with :func:`evaluate_global` -- the core's plain evaluation of the state on the
client's test split, never the trainer's own evaluation logic (personal parts, fine-tuning, ensembles), so every
algorithm's global model is scored alike. ``ClientTrainer.handle`` routes the message here, on every execution path.

A trainer whose ``on_evaluate`` scores exactly the state the evaluate message brings (FedAvg, FedProx: the personal
model is the global model) says so with ``personal_is_global = True`` in its own class body; the core then reuses
the personal numbers instead of evaluating the same model twice (core/engine/globaleval.py decides, per
evaluation, from what it can check: the messages carry the global state and no evaluation-time adaptation applies).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Mapping

from torch import nn

from .training import evaluation_reply

GLOBAL_EVALUATE = "evaluate_global"  # the message kind; its replies are evaluation sums like "evaluate"'s

# one scratch model per model factory (a run's clients share one factory): built once, loaded with each state
_SCRATCH: "weakref.WeakKeyDictionary[Callable[[], nn.Module], nn.Module]" = weakref.WeakKeyDictionary()


def _scratch_model(build_model: Callable[[], nn.Module]) -> nn.Module:
    try:
        model = _SCRATCH.get(build_model)
    except TypeError:  # a factory that cannot be weakly referenced: built each time
        return build_model()
    if model is None:
        model = build_model()
        _SCRATCH[build_model] = model
    return model


def evaluate_global(ctx: Any, payload: Mapping[str, Any]) -> Dict[str, Any]:
    """Score the global state ``payload["params"]`` on client ``ctx``'s test split: a model from the run's factory,
    loaded with the state (every key, strictly), evaluated as ``ClientTrainer.evaluate_model`` scores any model."""
    state = payload.get("params") if isinstance(payload, Mapping) else None
    if not isinstance(state, Mapping):
        raise ValueError(f"a '{GLOBAL_EVALUATE}' message carries the global model's state as 'params'")
    model = _scratch_model(ctx.build_model)
    model.load_state_dict(dict(state), strict=True)
    return evaluation_reply(model, ctx.test, getattr(ctx, "val", None), ctx.task, ctx.train_cfg.eval_batch_size)


def personal_is_global(trainer_cls: type) -> bool:
    """Whether ``trainer_cls`` itself (not a base class: a subclass may change what it scores) declares that its
    ``on_evaluate`` scores exactly the state an evaluate message brings (``personal_is_global = True``)."""
    return bool(vars(trainer_cls).get("personal_is_global", False))
