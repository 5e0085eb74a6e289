"""FedGen's equations as small pure functions, and its generator.

Zhu, Hong, Zhou: "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021. Notation: a
client model is w = (theta_f, theta_p), features z = f(x; theta_f) and the classifier (pflkit's ``head``)
g(z; theta_p); the generator G_w(y, eps) maps a label and noise to a feature vector z. Equation numbers are not cited: this was
written without a copy of the paper at hand; the formulas follow the authors' code (github.com/zhuangdizhu/FedGen).

* Server (the paper's generator objective over the label-weighted teacher ensemble): min_w E_{y ~ p(y)} E_{z ~ G_w(y)} [ l( sum_k alpha_k^y
  g(z; theta_p^k), y ) ], realised as in the authors' code (``serverpFedGen.train_generator``) by the label-weighted
  sum of the teachers' cross-entropies  sum_k mean_b[ alpha_k^{y_b} CE(g_k(z_b), y_b) ]     (``teacher_loss``),
  with alpha_k^y = c_k^y / sum_j c_j^y the share of label y held by client k                  (``label_weights``),
  plus the authors' diversity term  exp(-mean_{a,b}( d2(eps_a, eps_b) * d1(z_a, z_b) ))       (``diversity_loss``,
  d2 / d1: the mean squared / mean absolute difference over coordinates).
* Client (the paper's regularised local objective): min_theta  CE(real) + E_{y^ ~ p^(y), z ~ G_w(y^)} [ l(g(z; theta_p), y^) ], realised as in the
  authors' ``userpFedGen.train``:  CE(model(x), y) + (B_gen / B) alpha_t CE(g(G(y^)), y^)
  + beta_t KL(softmax(g(G(y))) || softmax(model(x)))  with alpha_t = max(1e-4, alpha 0.98^t) (``client_regulariser``,
  ``decayed``).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class FeatureGenerator(nn.Module):
    """G(y, eps) = Linear(hidden, d)(ReLU(BN(Linear(noise + C, hidden)([eps, onehot(y)])))) -- the authors'
    ``Generator`` with one hidden layer and a one-hot label input (their and PFLlib's architecture)."""

    def __init__(self, num_classes: int, feature_dim: int, hidden: int, noise: int):
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise
        self.hidden = nn.Sequential(nn.Linear(noise + num_classes, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.out = nn.Linear(hidden, feature_dim)

    def noise(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """eps ~ U[0, 1)^noise (the authors' ``torch.rand``, despite the paper's Gaussian)."""
        return torch.rand(n, self.noise_dim, generator=generator, device=device)

    def forward(self, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)
        return self.out(self.hidden(torch.cat([eps, onehot], dim=1)))


def decayed(weight: float, rnd_index: int, decay: float = 0.98, floor: float = 1e-4) -> float:
    """alpha_t = max(floor, alpha * decay^t), t the 0-based round index (the authors' ``exp_lr_scheduler``)."""
    return max(floor, weight * decay ** rnd_index)


def label_weights(counts: torch.Tensor, min_count: float = 1.0) -> Tuple[torch.Tensor, List[int]]:
    """From a (clients x classes) count matrix: alpha[y, k] = c_k^y / sum_j c_j^y (classes x clients) and the
    qualified labels, those some client holds more than ``min_count`` of (the authors' ``get_label_weights``)."""
    counts = counts.to(torch.float64)
    totals = counts.sum(dim=0)
    alpha = (counts / totals.clamp_min(1e-12)).T
    qualified = [int(y) for y in torch.nonzero(counts.max(dim=0).values > min_count).flatten()]
    return alpha.to(torch.float32), qualified


def teacher_loss(teacher_logits: Sequence[torch.Tensor], y: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """sum_k mean_b[ alpha[y_b, k] * CE(teacher_k(z_b), y_b) ]: each teacher's per-sample cross-entropy weighted by
    its share of the sample's label."""
    total = torch.zeros((), device=y.device)
    for k, logits in enumerate(teacher_logits):
        total = total + (F.cross_entropy(logits, y, reduction="none") * alpha[y, k]).mean()
    return total


def ensemble_logits(teacher_logits: Sequence[torch.Tensor], y: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """sum_k alpha[y_b, k] g_k(z_b): the label-weighted ensemble of the teachers' logits."""
    return sum(logits * alpha[y, k].unsqueeze(1) for k, logits in enumerate(teacher_logits))


def diversity_loss(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """exp(-mean_{a,b}( mean_i (eps_a - eps_b)_i^2 * mean_j |z_a - z_b|_j )): small when different noises give
    different features (the authors' ``DiversityLoss(metric='l1')``)."""
    z = z.reshape(z.shape[0], -1)
    noise_dist = ((eps.unsqueeze(0) - eps.unsqueeze(1)) ** 2).mean(dim=2)
    feature_dist = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(dim=2)
    return torch.exp(torch.mean(-noise_dist * feature_dist))


def client_regulariser(head: nn.Module, logits_real: torch.Tensor, z_real_labels: torch.Tensor,
                       z_sampled: torch.Tensor, y_sampled: torch.Tensor, alpha_t: float, beta_t: float,
                       gen_ratio: float) -> Dict[str, torch.Tensor]:
    """The two terms a client adds to its cross-entropy (the paper's regulariser, in the authors' form):

    * ``teacher``: (B_gen / B) * alpha_t * CE(head(z^), y^) on generated features z^ = G(y^) -- the gradient reaches
      the head only (the generator is not trained at the client);
    * ``latent``: beta_t * KL(softmax(head(G(y))) || softmax(model(x))) (batch mean) for the real batch's labels y,
      the target detached, so only the prediction on real data moves.
    """
    with torch.no_grad():
        target = F.softmax(head(z_real_labels), dim=1)
    latent = beta_t * F.kl_div(F.log_softmax(logits_real, dim=1), target, reduction="batchmean")
    teacher = gen_ratio * alpha_t * F.cross_entropy(head(z_sampled), y_sampled)
    return {"teacher": teacher, "latent": latent}
