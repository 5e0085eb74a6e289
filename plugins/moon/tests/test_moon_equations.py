"""MOON's model-contrastive loss on hand-computed examples (pflkit_moon.equations)."""
import math

import torch

from pflkit_moon.equations import model_contrastive_loss


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_l_con_by_hand():
    # sim(z, z_glob) = 1, sim(z, z_prev) = 0, tau 0.5: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    loss = model_contrastive_loss(t([1.0, 0.0]), t([3.0, 0.0]), t([0.0, 2.0]), tau=0.5)
    assert math.isclose(float(loss), math.log(1 + math.exp(-2)), rel_tol=1e-6)
    # the mirror case: z equals the previous representation -> log(1 + e^2)
    loss = model_contrastive_loss(t([0.0, 1.0]), t([3.0, 0.0]), t([0.0, 2.0]), tau=0.5)
    assert math.isclose(float(loss), math.log(1 + math.exp(2)), rel_tol=1e-6)


def test_batch_mean_cosine_and_flattening():
    z, g, p = t([1.0, 0.0], [1.0, 1.0]), t([1.0, 1.0], [1.0, 0.0]), t([0.0, 1.0], [-1.0, 1.0])
    one = [float(model_contrastive_loss(z[i:i + 1], g[i:i + 1], p[i:i + 1], 1.0)) for i in range(2)]
    both = model_contrastive_loss(z, g, p, 1.0)
    assert math.isclose(float(both), sum(one) / 2, rel_tol=1e-6)
    # second sample by hand: cos = 1/sqrt2 with z_glob, 0 with z_prev
    assert math.isclose(one[1], -math.log(math.exp(2 ** -0.5) / (math.exp(2 ** -0.5) + 1)), rel_tol=1e-6)
    # cosine: invariant to the scale of each representation; image-shaped features are flattened per sample
    assert torch.allclose(model_contrastive_loss(5 * z, 0.1 * g, 3 * p, 1.0), both)
    assert torch.allclose(model_contrastive_loss(z.reshape(2, 1, 2, 1), g.reshape(2, 2), p.reshape(2, 1, 2), 1.0),
                          both)


def test_only_z_gets_a_gradient_and_it_moves_toward_the_global_representation():
    z = t([1.0, 1.0]).requires_grad_(True)
    g, p = t([1.0, 0.0]).requires_grad_(True), t([0.0, 1.0]).requires_grad_(True)
    model_contrastive_loss(z, g, p, 0.5).backward()
    assert g.grad is None and p.grad is None
    assert z.grad[0, 0] < 0 < z.grad[0, 1]  # descent increases the glob direction, decreases the prev one
