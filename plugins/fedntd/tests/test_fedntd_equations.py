"""FedNTD's not-true distillation on hand-computed examples (pflkit_fedntd.equations)."""
import math

import torch

from pflkit_fedntd.equations import not_true_logits, ntd_loss


def test_not_true_logits_drop_each_samples_true_class():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert not_true_logits(logits, torch.tensor([2, 0])).tolist() == [[1.0, 2.0], [5.0, 6.0]]


def _softmax(v):
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


def test_ntd_loss_by_hand():
    # one sample of class 2, tau 2: local not-true logits (0, 1)/2, global (2, 0)/2
    local = torch.tensor([[0.0, 1.0, 9.0]])
    glob = torch.tensor([[2.0, 0.0, -3.0]])
    p, g = _softmax([0.0, 0.5]), _softmax([1.0, 0.0])
    want = 4 * sum(gi * math.log(gi / pi) for gi, pi in zip(g, p))  # tau^2 * KL(global || local)
    assert math.isclose(float(ntd_loss(local, glob, torch.tensor([2]), tau=2.0)), want, rel_tol=1e-6)


def test_batch_mean_and_true_class_ignored():
    local = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])
    glob = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]])
    y = torch.tensor([0, 1])
    both = ntd_loss(local, glob, y, 1.0)
    one = [ntd_loss(local[i:i + 1], glob[i:i + 1], y[i:i + 1], 1.0) for i in range(2)]
    assert torch.allclose(both, (one[0] + one[1]) / 2)  # "batchmean": the sum over samples / batch size
    moved = local.clone()
    moved[0, 0] += 7.0
    moved[1, 1] -= 4.0  # only the true classes' logits change
    assert torch.equal(ntd_loss(moved, glob, y, 1.0), both)
    # zero when the not-true classes agree, whatever the true class says
    agree = glob.clone()
    agree[0, 0], agree[1, 1] = 10.0, -10.0
    assert float(ntd_loss(agree, glob, y, 1.0)) < 1e-7


def test_only_the_local_logits_get_a_gradient():
    local = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    glob = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    ntd_loss(local, glob, torch.tensor([1]), 1.0).backward()
    assert glob.grad is None
    assert local.grad[0, 1] == 0 and local.grad[0, 0] != 0  # the true class gets none either
