"""FedGen's equations on hand-made tensors."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflkit_fedgen.equations import (FeatureGenerator, client_regulariser, decayed, diversity_loss, ensemble_logits,
                                     label_weights, teacher_loss)


def test_label_weights_are_each_clients_share_of_a_label():
    counts = torch.tensor([[1, 3, 1], [1, 1, 5]])  # 2 clients x 3 classes (the authors' counts start at 1)
    alpha, qualified = label_weights(counts)
    assert torch.allclose(alpha, torch.tensor([[0.5, 0.5], [0.75, 0.25], [1 / 6, 5 / 6]]))
    assert qualified == [1, 2]  # label 0: no client trained on it (max count 1)


def test_teacher_loss_weighs_each_teachers_cross_entropy_by_its_label_share():
    y = torch.tensor([0, 1])
    a, b = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    alpha = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    ce_a, ce_b = F.cross_entropy(a, y, reduction="none"), F.cross_entropy(b, y, reduction="none")
    want = (ce_a[0] * 0.25 + ce_a[1] * 1.0) / 2 + (ce_b[0] * 0.75 + ce_b[1] * 0.0) / 2
    assert float(teacher_loss([a, b], y, alpha)) == pytest.approx(float(want))
    ens = ensemble_logits([a, b], y, alpha)
    assert torch.allclose(ens, torch.tensor([[0.5, 0.0], [0.0, 1.0]]))


def test_diversity_loss_by_hand():
    eps = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # mean squared distance 1 off the diagonal
    z = torch.tensor([[0.0, 0.0], [2.0, 4.0]])  # mean absolute distance 3
    assert float(diversity_loss(eps, z)) == pytest.approx(math.exp(-(1 * 3 + 1 * 3) / 4))
    assert float(diversity_loss(eps, torch.zeros(2, 2))) == 1.0  # collapsed features: the largest loss


def test_decayed_weight():
    assert decayed(10.0, 0) == 10.0
    assert decayed(10.0, 3) == pytest.approx(10.0 * 0.98 ** 3)
    assert decayed(1e-3, 1000) == 1e-4  # the authors' floor


def test_client_regulariser_terms_and_gradients():
    torch.manual_seed(0)
    head = nn.Linear(3, 2)
    logits_real = torch.randn(4, 2, requires_grad=True)
    z_real, z_hat = torch.randn(4, 3), torch.randn(5, 3)
    y_hat = torch.tensor([0, 1, 1, 0, 1])
    terms = client_regulariser(head, logits_real, z_real, z_hat, y_hat, alpha_t=2.0, beta_t=3.0, gen_ratio=0.5)
    target = F.softmax(head(z_real), dim=1).detach()
    latent = 3.0 * (target * (target.log() - F.log_softmax(logits_real, dim=1))).sum(dim=1).mean()
    assert float(terms["latent"].detach()) == pytest.approx(float(latent.detach()), rel=1e-5)
    assert float(terms["teacher"].detach()) == pytest.approx(float(0.5 * 2.0 * F.cross_entropy(head(z_hat), y_hat).detach()), rel=1e-6)
    # the latent term moves the prediction on real data only; the teacher term reaches the head
    head.zero_grad()
    terms["latent"].backward(retain_graph=True)
    assert head.weight.grad is None and logits_real.grad is not None
    terms["teacher"].backward()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


def test_generator_maps_labels_and_noise_to_features():
    g = FeatureGenerator(num_classes=3, feature_dim=5, hidden=8, noise=4).eval()
    eps = g.noise(6, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert eps.shape == (6, 4) and float(eps.min()) >= 0 and float(eps.max()) < 1  # U[0, 1), the authors'
    z = g(torch.tensor([0, 1, 2, 0, 1, 2]), eps)
    assert z.shape == (6, 5)
    assert g.hidden[0].in_features == 4 + 3  # [eps, onehot(y)]
