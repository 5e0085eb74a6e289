"""The one local-training loop and the one evaluation loop every trainer uses.

Data live as tensors on the training device; mini-batches are index slices from a seeded permutation, so there
is no DataLoader, no per-sample Python and no re-reading. Losses are accumulated on the device and synchronised
once per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from .task import Task


@dataclass
class TensorData:
    """A client's split: inputs and targets on one device, plus an optional per-batch input transform."""

    x: torch.Tensor
    y: torch.Tensor
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batch(self, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``idx`` as ``(x, y)``, with the data's ``transform`` applied to ``x``."""
        x = self.x[idx]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.y[idx]

    def all(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every sample as ``(x, y)``, with the data's ``transform`` applied to ``x``."""
        x = self.x if self.transform is None else self.transform(self.x)
        return x, self.y


def minibatches(data: TensorData, batch_size: int, epochs: int = 1, shuffle: bool = True,
                generator: Optional[torch.Generator] = None, drop_last: bool = False
                ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``epochs`` passes of mini-batches; one seeded permutation per epoch."""
    for idx in batch_indices(len(data), batch_size, epochs, shuffle, generator, drop_last, data.y.device):
        yield data.batch(idx)


def batch_indices(n: int, batch_size: int, epochs: int = 1, shuffle: bool = True,
                  generator: Optional[torch.Generator] = None, drop_last: bool = False,
                  device: Optional[torch.device] = None) -> Iterator[torch.Tensor]:
    """The sample indices of ``minibatches``' batches, drawn from ``generator`` exactly as it draws them (the
    batched execution of a round's clients replays each client's order from here)."""
    if n == 0:
        return
    for _ in range(epochs):
        order = (torch.randperm(n, generator=generator) if shuffle else torch.arange(n)).to(device)
        stop = n - (n % batch_size) if drop_last and n >= batch_size else n
        for start in range(0, stop, batch_size):
            yield order[start:start + batch_size]


def make_optimizer(params: Iterable[torch.nn.Parameter], train_cfg, lr: Optional[float] = None
                   ) -> torch.optim.Optimizer:
    """Build the configured optimizer (``train.optimizer``/``lr``/``momentum``/``weight_decay``); it carries
    ``train.max_grad_norm`` as ``optimizer.max_grad_norm``, which ``run_sgd`` applies before every step."""
    lr = train_cfg.lr if lr is None else lr
    params = [p for p in params if p.requires_grad]
    if train_cfg.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, weight_decay=train_cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay)
    opt.max_grad_norm = train_cfg.get("max_grad_norm")  # on the optimizer, so every call site gets it unchanged
    return opt


def clip_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Scale the gradients of ``optimizer``'s parameters to total 2-norm ``optimizer.max_grad_norm`` (if set)."""
    limit = getattr(optimizer, "max_grad_norm", None)
    if limit:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], float(limit))


def run_sgd(batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
            compute_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            optimizer: torch.optim.Optimizer,
            after_step: Optional[Callable[[], None]] = None) -> float:
    """Minimise ``compute_loss`` over ``batches``; returns the mean training loss (one device sync)."""
    total = None
    steps = 0
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(x, y)
        loss.backward()
        clip_gradients(optimizer)
        optimizer.step()
        if after_step is not None:
            after_step()
        total = loss.detach() if total is None else total + loss.detach()
        steps += 1
    return float(total.item()) / steps if steps else 0.0


@dataclass
class EvalResult:
    """Sums over one client's test split (means are taken by the evaluation summary)."""

    num_samples: int
    loss_sum: float
    metric_sum: float

    @property
    def metric(self) -> float:
        return self.metric_sum / self.num_samples if self.num_samples else float("nan")

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_samples if self.num_samples else float("nan")

    def as_dict(self) -> dict:
        return {"num_samples": self.num_samples, "loss_sum": self.loss_sum, "metric_sum": self.metric_sum}


VAL_PREFIX = "val_"  # an evaluate reply's validation sums: val_loss_sum, val_metric_sum (split.val)


def evaluation_reply(forward: Callable[[torch.Tensor], torch.Tensor] | nn.Module, test: TensorData,
                     val: Optional[TensorData], task: Task, batch_size: int = 1024,
                     modules: Iterable[nn.Module] = ()) -> dict:
    """An evaluate reply: ``forward``'s sums on the client's test split and, when the client holds a validation split
    (``split.val``), on that too as ``val_loss_sum`` / ``val_metric_sum`` -- the same model scored once per split."""
    reply = evaluate(forward, test, task, batch_size, modules).as_dict()
    if val is not None:
        scored = evaluate(forward, val, task, batch_size, modules)
        reply[f"{VAL_PREFIX}loss_sum"], reply[f"{VAL_PREFIX}metric_sum"] = scored.loss_sum, scored.metric_sum
    return reply


def _loss_sum(task: Task, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's loss summed over samples (per target value for a regression target of several values)."""
    if task.kind == "classification":
        return task.loss(out, y, reduction="sum")
    return task.loss(out, y, reduction="sum") / max(1, y[0].numel())


@torch.no_grad()
def evaluate(forward: Callable[[torch.Tensor], torch.Tensor] | nn.Module, data: TensorData, task: Task,
             batch_size: int = 1024, modules: Iterable[nn.Module] = ()) -> EvalResult:
    """Score ``forward`` on ``data`` with the task's loss and metric.

    ``forward`` (when a module) and ``modules`` are put in eval mode for the call and restored afterwards.
    """
    modules = ([forward] if isinstance(forward, nn.Module) else []) + list(modules)
    was_training = [m.training for m in modules]
    for m in modules:
        set_mode(m, False)
    try:
        if 0 < len(data) <= batch_size and data.transform is None:
            # one batch (the common case): the split itself, no index copy; the sums in the accumulators' dtype
            # (the default float dtype), rounded to it as ``0 + v`` would be
            x, y = data.x, data.y
            out = forward(x)
            dtype = torch.get_default_dtype()
            loss_sum = _loss_sum(task, out, y).to(dtype)
            metric_sum = task.metric_sum(out, y).to(dtype)
        else:
            loss_sum = torch.zeros((), device=data.y.device)
            metric_sum = torch.zeros((), device=data.y.device)
            for x, y in minibatches(data, batch_size, shuffle=False):
                out = forward(x)
                loss_sum += _loss_sum(task, out, y)
                metric_sum += task.metric_sum(out, y)
    finally:
        for m, t in zip(modules, was_training):
            set_mode(m, t)
    return EvalResult(len(data), float(loss_sum.item()), float(metric_sum.item()))


def set_mode(module: nn.Module, mode: bool) -> None:
    """``module.train(mode)``: every sub-module's ``training`` flag set to ``mode``. Where no sub-module changes
    ``train``, ``eval`` or attribute setting, the flags are written directly, and only those that differ: the same
    flags as ``train(mode)``'s recursion, which costs as much as a small model's forward pass (once to score, once
    to restore, for every client's evaluation)."""
    subs = list(module.modules())
    if not all(type(s).train is _TRAIN and type(s).eval is _EVAL and type(s).__setattr__ is _SETATTR for s in subs):
        module.train(mode)
        return
    for s in subs:
        if s.training is not mode:
            s.__dict__["training"] = mode


_TRAIN, _EVAL, _SETATTR = nn.Module.train, nn.Module.eval, nn.Module.__setattr__
