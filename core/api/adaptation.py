"""Evaluation-time adaptation: fine-tune a scratch copy of a client's evaluated model on its own training split,
score the copy, discard it.

"+FT" evaluation (PFLlib/FL-bench's fine-tuning before testing), FedBABU's fine-tuning and Per-FedAvg's one-step
adaptation are the same operation: N SGD steps or epochs, over a chosen parameter subset, at a chosen learning rate,
on the client's training split only. It never changes what the client keeps: the copy is discarded, so the declared
state is bit for bit what it was before the call (a pooled store stores nothing) and the next round trains from the
same state as without adaptation. Its batches come from the call's generator (``ctx.generator``, seeded from
(seed, round, client, call) before every call), so it does not perturb the randomness of training either.

Controlled by the core keys ``eval.adapt`` (never | every | final), ``eval.adapt_steps`` / ``eval.adapt_epochs``,
``eval.adapt_lr`` and ``eval.adapt_params``. A trainer customises it through the hooks of ``AdaptationHooks`` (a
base of ``LocalSGDTrainer``). The evaluate reply carries the cost (``adapt_steps``, ``adapt_seconds``); the run sums
it over clients into the round's record (``adapt/steps``, ``adapt/seconds``, ``adapt/clients``).
"""
from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional

import torch
from torch import nn

from ..common.errors import ConfigError
from .state import module_keys
from .training import clip_gradients, make_optimizer

MODES = ("never", "every", "final")
DEFAULT_EPOCHS = 1  # when eval.adapt is on and neither adapt_steps nor adapt_epochs is given
REPLY_STEPS, REPLY_SECONDS = "adapt_steps", "adapt_seconds"


@dataclass(frozen=True)
class AdaptationSettings:
    """The resolved ``eval.adapt*`` keys of a run (``None`` in a client context when ``eval.adapt = never``)."""

    mode: str
    steps: Optional[int]  # exactly one of steps / epochs is set
    epochs: Optional[int]
    lr: Optional[float]  # None: the trainer's ``adaptation_lr()`` (train.lr, or a method's own, e.g. Per-FedAvg's alpha)
    params: str  # a name in the trainer's ``adapt_param_sets``
    rounds: Optional[FrozenSet[int]] = None  # the evaluation rounds that adapt; None: all of them

    def applies(self, rnd: int) -> bool:
        """Whether evaluation at round ``rnd`` adapts (every evaluation when ``rounds`` is None)."""
        return self.rounds is None or rnd in self.rounds


def evaluation_rounds(rounds: int, every: int) -> List[int]:
    """The rounds a run evaluates in (the simulation's rule: every ``every`` rounds, and always the last round)."""
    return [r for r in range(1, rounds + 1) if r % every == 0 or r == rounds]


def settings_from_config(cfg: Mapping[str, Any]) -> Optional[AdaptationSettings]:
    """The run's adaptation settings, or None when it does not adapt. Raises ConfigError on a contradiction.

    ``final`` adapts the evaluations that make up the reported "final" metric -- the last ``eval.final_k``
    evaluations of the run -- so that metric is entirely adapted (the "best" then compares adapted with
    unadapted evaluations: use ``every`` when the curve or the best round matters)."""
    ev = cfg["eval"]
    mode = ev.get("adapt", "never")
    steps, epochs = ev.get("adapt_steps"), ev.get("adapt_epochs")
    if steps is not None and epochs is not None:
        raise ConfigError(f"eval.adapt_steps ({steps}) and eval.adapt_epochs ({epochs}) are both set: give one of "
                          f"them (an algorithm's defaults may set one; clear it with e.g. --set eval.adapt_epochs=null)")
    if mode == "never":
        return None
    if steps is None and epochs is None:
        epochs = DEFAULT_EPOCHS
    rounds = None
    if mode == "final":
        rounds = frozenset(evaluation_rounds(int(cfg["rounds"]), int(ev["every"]))[-int(ev["final_k"]):])
    return AdaptationSettings(mode, steps, epochs, ev.get("adapt_lr"), ev.get("adapt_params", "all"), rounds)


def check_trainer(trainer_cls: type, settings: Optional[AdaptationSettings], trainer_name: str = "") -> None:
    """Refuse adaptation for a trainer that cannot do it (one line): its ``on_evaluate`` must come from a class that
    declares ``adapts_at_evaluation = True`` (LocalSGDTrainer's does; an override that calls ``evaluate_adapted``
    itself declares it too), and ``eval.adapt_params`` must name one of its ``adapt_param_sets``."""
    if settings is None:
        return
    name = trainer_name or getattr(trainer_cls, "__name__", str(trainer_cls))
    owner = next((k for k in trainer_cls.__mro__ if "on_evaluate" in vars(k)), None)
    if owner is None or not vars(owner).get("adapts_at_evaluation", False):
        where = f" ({owner.__name__}.on_evaluate scores without it)" if owner is not None else ""
        raise ConfigError(f"eval.adapt: trainer '{name}' does not support evaluation-time adaptation{where}; "
                          f"use eval.adapt=never")
    sets = tuple(getattr(trainer_cls, "adapt_param_sets", ()))
    if settings.params not in sets:
        raise ConfigError(f"eval.adapt_params: {settings.params!r} is not a parameter set of trainer '{name}' "
                          f"(choose from: {', '.join(sets)})")


def check_model(trainer_cls: type, build_model, settings: Optional[AdaptationSettings]) -> None:
    """Resolve the adapted parameter subset on a freshly built model, so a model lacking it (no ``head``) is one
    clear error before the run starts rather than a failure at every client's evaluation."""
    if settings is None:
        return
    trainer_cls.adaptation_params(build_model(), settings.params)


class AdaptationHooks:
    """What a trainer may override to shape its evaluation-time adaptation (LocalSGDTrainer has these defaults).

    * ``adapt_param_sets`` / ``adaptation_params``: the names ``eval.adapt_params`` accepts and the parameters of
      the scratch copy each selects (all, head = ``head.*``, body = ``features.*``); add names for other subsets.
    * ``adaptation_module()``: the module that is copied, adapted and scored (default: ``personal_forward()``).
    * ``adaptation_lr()``: the step size when ``eval.adapt_lr`` is null (default: ``train.lr``).
    * ``adapt(scratch, settings)``: the adaptation itself; returns the number of optimiser steps taken.
    """

    adapt_param_sets = ("all", "head", "body")

    @classmethod
    def adaptation_params(cls, module: nn.Module, which: str) -> List[nn.Parameter]:
        if which == "all":
            return list(module.parameters())
        prefix = {"head": "head", "body": "features"}.get(which)
        if prefix is None:
            raise ConfigError(f"eval.adapt_params: {which!r} is not a parameter set of {cls.__name__} "
                              f"(choose from: {', '.join(cls.adapt_param_sets)})")
        sub = getattr(module, prefix, None)
        if not isinstance(sub, nn.Module) or not module_keys(module, prefix):
            raise ConfigError(f"eval.adapt_params={which}: model {type(module).__name__} has no '{prefix}' "
                              f"sub-module (a features/head split is needed)")
        return list(sub.parameters())

    def adaptation_module(self) -> nn.Module:
        forward = self.personal_forward()
        if not isinstance(forward, nn.Module):
            raise TypeError(f"{type(self).__name__}.personal_forward() is not a module, so there is nothing to copy "
                            f"and adapt: override adaptation_module() (or use eval.adapt=never)")
        return forward

    def adaptation_lr(self) -> float:
        return float(self.ctx.train_cfg.lr)

    def adapt(self, scratch: nn.Module, settings: AdaptationSettings) -> int:
        return fine_tune(self, scratch, settings)


def fine_tune(trainer: Any, scratch: nn.Module, settings: AdaptationSettings) -> int:
    """SGD on ``scratch`` (a copy: the caller discards it) over the chosen parameters only, minimising the trainer's
    data term (``data_loss``) on mini-batches of the client's training split drawn from the call's generator:
    ``settings.epochs`` epochs, or the first ``settings.steps`` mini-batches of as many epochs as needed. The
    configured optimiser (``train.optimizer``, momentum, weight decay, clipping) starts fresh. Returns the steps."""
    chosen = {id(p) for p in trainer.adaptation_params(scratch, settings.params)}
    for p in scratch.parameters():  # frozen parameters get no gradient and are in no optimiser: they stay exact
        p.requires_grad_(id(p) in chosen)
    lr = settings.lr if settings.lr is not None else trainer.adaptation_lr()
    optimizer = make_optimizer(scratch.parameters(), trainer.ctx.train_cfg, lr=lr)
    batches = trainer.batches(epochs=settings.epochs if settings.epochs is not None else settings.steps)
    if settings.steps is not None:  # every epoch has at least one batch, so `steps` epochs always suffice
        batches = itertools.islice(batches, settings.steps)
    scratch.train()
    steps = 0
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        trainer.data_loss(scratch, x, y).backward()
        clip_gradients(optimizer)
        optimizer.step()
        steps += 1
    return steps


def evaluate_adapted(trainer: Any, settings: AdaptationSettings) -> Dict[str, Any]:
    """Adapt a scratch copy of ``trainer.adaptation_module()``, score it on the test split, discard it. The reply
    holds the usual evaluation sums plus the cost (``adapt_steps``, ``adapt_seconds``)."""
    start = time.perf_counter()
    module = trainer.adaptation_module()
    scratch = copy.deepcopy(module)
    with torch.enable_grad():
        steps = trainer.adapt(scratch, settings)
    result = trainer.evaluate_model(scratch)
    result[REPLY_STEPS] = int(steps)
    result[REPLY_SECONDS] = time.perf_counter() - start
    return result


def cost_summary(results: Mapping[int, Mapping[str, Any]]) -> Dict[str, float]:
    """The round's adaptation cost summed over the clients that adapted (empty when none did)."""
    adapted = [r for r in results.values() if REPLY_STEPS in r]
    if not adapted:
        return {}
    return {"adapt/clients": len(adapted),
            "adapt/steps": int(sum(int(r[REPLY_STEPS]) for r in adapted)),
            "adapt/seconds": float(sum(float(r.get(REPLY_SECONDS, 0.0)) for r in adapted))}
