"""FedNTD's not-true distillation as small pure functions.

Lee, Jeong, Shin, Bae, Yun: "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
NeurIPS 2022, Section 4 (FedNTD). For a sample (x, y) with local logits q = f(x; w) and the received global
model's logits q_g = f(x; w^t):

    not_true_logits   q~: the C - 1 logits of the classes other than y (the true class is dropped *before* the
                      softmax, so the softmax renormalises over the not-true classes)
    ntd_loss          L_NTD = tau^2 * KL( softmax(q~_g / tau) || softmax(q~ / tau) ), averaged over the batch
                      ("batchmean"); the global model's distribution is the target
    (objective)       L = CE(q, y) + beta * L_NTD

Equation numbers are not cited: this was written without a copy of the paper at hand; the tau^2 factor and the
batch-mean reduction are those of the authors' code (github.com/Lee-Gihun/FedNTD, ``algorithms/fedntd/criterion.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def not_true_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The (B, C-1) logits of every class but the sample's true one, in class order."""
    batch, classes = logits.shape
    # column j of the result is class j below the true class t and class j + 1 from t on: a gather, not a boolean
    # mask, so the shape is static (clients.batched runs this under vmap)
    cols = torch.arange(classes - 1, device=logits.device).unsqueeze(0).expand(batch, -1)
    true = targets.reshape(-1, 1).long()
    return logits.gather(1, cols + (cols >= true).long())


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, targets: torch.Tensor, tau: float) -> torch.Tensor:
    """L_NTD = tau^2 * KL(softmax(q~_g/tau) || softmax(q~/tau)), batch mean; ``global_logits`` get no gradient."""
    log_local = F.log_softmax(not_true_logits(logits, targets) / tau, dim=1)
    target = F.softmax(not_true_logits(global_logits.detach(), targets) / tau, dim=1)
    return tau ** 2 * F.kl_div(log_local, target, reduction="batchmean")
