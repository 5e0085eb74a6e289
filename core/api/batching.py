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

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn


class BatchedFormError(ValueError):
    """A batched form or phase whose fields are not what the core can run (one line: the field and why)."""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


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

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise BatchedFormError(f"BatchedPhase.loss: {self.loss!r} is not callable")
        if isinstance(self.trains, str) or not all(isinstance(n, str) for n in self.trains):
            raise BatchedFormError(f"BatchedPhase.trains: expected a list of tensor names, got {self.trains!r}")
        if not _count(self.epochs):
            raise BatchedFormError(f"BatchedPhase.epochs: {self.epochs!r} is invalid: must be a count >= 0")
        if self.batch_size is not None and not (_count(self.batch_size) and self.batch_size >= 1):
            raise BatchedFormError(f"BatchedPhase.batch_size: {self.batch_size!r} is invalid: must be an integer "
                                   f">= 1 (or None: train.batch_size)")
        if self.lr is not None and not _rate(self.lr):
            raise BatchedFormError(f"BatchedPhase.lr: {self.lr!r} is invalid: must be a finite number > 0 (or None: "
                                   f"train.lr)")
        for name, lr in (self.lrs or {}).items():
            if not _rate(lr):
                raise BatchedFormError(f"BatchedPhase.lrs[{name!r}]: {lr!r} is invalid: must be a finite number > 0")


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

    def __post_init__(self) -> None:
        if not isinstance(self.modules, dict) or not self.modules or \
                not all(isinstance(m, nn.Module) for m in self.modules.values()):
            raise BatchedFormError(f"BatchedForm.modules: expected {{name: nn.Module}}, got {self.modules!r}"[:200])
        if not isinstance(self.phases, (list, tuple)) or not all(isinstance(p, BatchedPhase) for p in self.phases):
            raise BatchedFormError("BatchedForm.phases: expected a list of BatchedPhase")
        if not callable(self.reply):
            raise BatchedFormError("BatchedForm.reply: expected a callable (losses, start, aux) -> reply")


def trained_names(module: nn.Module, prefix: str, under: Optional[str] = None) -> List[str]:
    """``prefix.name`` of each parameter of ``module`` that requires grad (only those under sub-module ``under``)."""
    return [f"{prefix}.{n}" for n, p in module.named_parameters()
            if p.requires_grad and (under is None or n.startswith(under + "."))]
