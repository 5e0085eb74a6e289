"""FedC2I Eq. 4-10 on hand-made tensors with hand-computed results."""
import math

import pytest
import torch
import torch.nn.functional as F

from pflkit_fedc2i.equations import (class_level_losses, classifier_rows, influence_weights, leave_one_out_mean,
                                     weighted_state, weighted_sum)


def test_eq4_leave_one_out_mean():
    x = torch.tensor([[1.0, 10.0], [2.0, 20.0], [6.0, 60.0]])
    # client 0 left out: mean of rows 1, 2 = (2+6)/2, (20+60)/2; and so on
    expected = torch.tensor([[4.0, 40.0], [3.5, 35.0], [1.5, 15.0]])
    assert torch.allclose(leave_one_out_mean(x), expected)
    with pytest.raises(ValueError):
        leave_one_out_mean(x[:1])


def test_eq5_influence_weights_by_hand():
    losses = torch.tensor([1.0, 2.0])
    assert torch.allclose(influence_weights(losses, 1.0), torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
    assert torch.allclose(influence_weights(losses, 2.0), torch.tensor([1 / 5, 4 / 5], dtype=torch.float64))
    # gamma = 0: every client the same weight, whatever the losses
    assert torch.equal(influence_weights(torch.tensor([0.1, 5.0, 2.0]), 0.0),
                       torch.full((3,), 1 / 3, dtype=torch.float64))
    # large gamma: no overflow, the largest loss dominates; 0.5^... vs 1
    w = influence_weights(torch.tensor([0.5, 1.0, 1e3]), 200.0)
    assert torch.isfinite(w).all() and w[2] == pytest.approx(1.0) and w.sum() == pytest.approx(1.0)
    # a zero loss weighs 0 (0^gamma); all zero -> uniform
    assert torch.allclose(influence_weights(torch.tensor([0.0, 3.0]), 5.0), torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(influence_weights(torch.zeros(4), 5.0), torch.full((4,), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError):
        influence_weights(losses, -1.0)


def test_eq9_normalises_over_clients_per_class():
    # losses [M=2, C=2]; column c normalised over the clients: gamma = 1
    losses = torch.tensor([[1.0, 3.0], [3.0, 1.0]])
    lam = influence_weights(losses, 1.0, dim=0)
    assert torch.allclose(lam, torch.tensor([[0.25, 0.75], [0.75, 0.25]], dtype=torch.float64))
    assert torch.allclose(lam.sum(dim=0), torch.ones(2, dtype=torch.float64))


def test_eq6_weighted_sum_and_state():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w = torch.tensor([0.5, 0.25, 0.25])
    assert torch.allclose(weighted_sum(x, w), torch.tensor([0.5 + 0.75 + 1.25, 1.0 + 1.0 + 1.5]))
    states = [{"a": torch.tensor([1.0]), "n": torch.tensor(7)}, {"a": torch.tensor([3.0]), "n": torch.tensor(9)}]
    out = weighted_state(states, torch.tensor([0.25, 0.75]), states[1])
    assert torch.allclose(out["a"], torch.tensor([2.5])) and out["n"].item() == 9  # counters stay own


def test_eq7_class_level_losses_by_hand():
    # one sample, feature 1, label 0; phi_m: W = [[1], [0]], b = 0 -> logits [1, 0]
    feats = torch.tensor([[1.0]])
    y = torch.tensor([0])
    weight, bias = torch.tensor([[1.0], [0.0]]), torch.zeros(2)
    # leave-one-out rows: for i = 0 both rows 0; for i = 1 rows [2], [1]
    loo_w = torch.tensor([[[0.0], [0.0]], [[2.0], [1.0]]])
    loo_b = torch.zeros(2, 2)
    got = class_level_losses(feats, y, weight, bias, loo_w, loo_b, F.cross_entropy)
    lse = lambda a, b: math.log(math.exp(a) + math.exp(b))
    expected = torch.tensor([
        [lse(0, 0) - 0, lse(1, 0) - 1],   # (i=0, c=0): logits [0, 0]; (i=0, c=1): logits [1, 0]
        [lse(2, 0) - 2, lse(1, 1) - 1],   # (i=1, c=0): logits [2, 0]; (i=1, c=1): logits [1, 1]
    ])
    assert torch.allclose(got, expected, atol=1e-6)


def test_eq7_matches_evaluating_every_replaced_classifier():
    g = torch.Generator().manual_seed(0)
    b, d, c, m = 7, 5, 4, 3
    feats = torch.randn(b, d, generator=g)
    y = torch.randint(0, c, (b,), generator=g)
    weight, bias = torch.randn(c, d, generator=g), torch.randn(c, generator=g)
    loo_w, loo_b = torch.randn(m, c, d, generator=g), torch.randn(m, c, generator=g)
    got = class_level_losses(feats, y, weight, bias, loo_w, loo_b, F.cross_entropy)
    for i in range(m):
        for k in range(c):
            w2, b2 = weight.clone(), bias.clone()
            w2[k], b2[k] = loo_w[i, k], loo_b[i, k]
            assert got[i, k] == pytest.approx(float(F.cross_entropy(feats @ w2.T + b2, y)), abs=1e-5)


def test_eq10_readings():
    weights = torch.tensor([[[1.0], [3.0]], [[5.0], [7.0]]])  # [M=2, C=2, d=1]
    biases = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    lam = torch.tensor([[0.25, 1.0], [0.75, 0.0]])  # columns sum to 1
    w, b = classifier_rows(weights, biases, lam, own=0, reading="weighted")
    assert torch.allclose(w, torch.tensor([[0.25 * 1 + 0.75 * 5], [3.0]]))
    assert torch.allclose(b, torch.tensor([0.25 * 0 + 0.75 * 2, 1.0]))
    w, b = classifier_rows(weights, biases, lam, own=1, reading="printed")  # sum_i Lambda phi_{m,c} = phi_{m,c}
    assert torch.equal(w, weights[1]) and torch.equal(b, biases[1])
    with pytest.raises(ValueError):
        classifier_rows(weights, biases, lam, own=0, reading="other")
