"""A trainer's declared functional form of its local update, which lets the core train a round's clients as one
vectorised model (``clients.batched``, core/engine/batched.py).

The form names the trainer's modules whose tensors each client holds, and the phases of its local update: each
phase minimises one loss over some of those parameters for some epochs of the client's own mini-batches, drawn
from its generator in phase order, as ``ClientTrainer.batches`` draws them. The loss is the trainer's own code; the
core calls it with one stacked client's tensors substituted into the modules (``torch.func.functional_call``), so it
must reach parameters through the modules (``self.model(x)``, ``self.model.named_parameters()``), never through
lists of parameter objects kept aside, and may read only what is the same for every client (hyperparameters, the
task). ``reply`` builds the fit reply on the client's own trainer once its trained tensors are back in its modules.
A loss that needs more per client and step than its mini-batch (PCFL's batch of synthetic samples, drawn from the
client's own generator) declares it as ``BatchedPhase.inputs``: drawn per client before the stacked steps and passed
to the loss after ``x, y``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn


@dataclass
class BatchedPhase:
    """One phase: minimise ``loss(x, y)`` over the parameters named in ``trains`` (``"<module>.<parameter>"``, the
    form's module names) for ``epochs`` epochs of mini-batches (``batch_size``: None = ``train.batch_size``;
    ``drop_last`` as ``ClientTrainer.batches``), with a fresh ``train.optimizer`` (``lr``: None = ``train.lr``), as
    ``make_optimizer`` + ``run_sgd`` would. With ``aux`` the loss returns ``(loss, {name: scalar tensor})`` and each
    client's values are summed over its steps (a metric the sequential loss accumulates on the trainer). ``lrs``:
    the learning rate of some trained tensors, as a second optimizer over them with its own ``lr`` would use
    (FedRoD's personal head). ``projected``: trained tensors that ``train.optimizer`` does not update; each step
    sets them to ``clamp(t - lr * grad, low, high)`` (no momentum, weight decay or clipping: APFL's alpha)."""

    loss: Callable[[torch.Tensor, torch.Tensor], Any]
    trains: Sequence[str]
    epochs: int
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    drop_last: bool = False
    aux: bool = False
    lrs: Optional[Dict[str, float]] = None  # learning rates of some trained tensors (name -> lr), the others ``lr``
    projected: Optional[Dict[str, tuple]] = None  # name -> (lr, low, high): plain projected gradient steps
    # per-step inputs of the loss beyond (x, y): called with the phase's step count on the client's own trainer, in
    # phase order once its batch order is drawn; returns its StepInputs (None: none, the loss gets x, y only)
    inputs: Optional[Callable[[int], Optional["StepInputs"]]] = None


@dataclass
class StepInputs:
    """One client's extra inputs of a phase's loss, per step: step ``s`` (in the phase's order, as the sequential
    loop takes them) calls ``loss(x, y, *source.batch(index[s]))``. ``index``: [steps, m] sample indices into
    ``source`` (anything with ``batch(idx) -> tuple of tensors``, e.g. a ``TensorData``). The clients stacked in one
    group have the same ``m`` and the same tensor shapes (clients that differ are stacked in different groups).
    Drawn before the steps, so they must come from a generator of their own, not the one that draws the batch
    order."""

    source: Any
    index: torch.Tensor


@dataclass
class BatchedForm:
    """``modules``: name -> the trainer's module whose parameters and buffers each client holds; ``phases`` in order;
    ``reply(losses, start, aux)``: the fit reply from each phase's mean training loss, with the client's trained
    tensors in the modules, ``start`` holding its tensors (``"<module>.<name>"``) as the update began and ``aux`` the
    sums of the ``aux`` phases' values (name -> float). The reply called is the one of the form the client's trainer
    built right after its ``batched_begin``, so it may keep what that computed for the client (FedC2I's influence
    weights): a pooled trainer serves other clients in between."""

    modules: Dict[str, nn.Module]
    phases: List[BatchedPhase]
    reply: Callable[[List[float], Dict[str, torch.Tensor], Dict[str, float]], Dict[str, Any]]
    eval_modules: Sequence[str] = ()  # modules the local update runs in eval mode (the others train)


def trained_names(module: nn.Module, prefix: str, under: Optional[str] = None) -> List[str]:
    """``prefix.name`` of each parameter of ``module`` that requires grad (only those under sub-module ``under``)."""
    return [f"{prefix}.{n}" for n, p in module.named_parameters()
            if p.requires_grad and (under is None or n.startswith(under + "."))]
