"""FedPHP's equations on hand-made tensors."""
import math

import pytest
import torch

from pflkit_fedphp.equations import hpm_momentum, hpm_update, kd_transfer, local_objective, mmd_rbf


def test_kd_transfer_is_the_cross_entropy_to_the_tempered_teacher():
    # uniform student: -sum_c p_c log(1/C) = log C whatever the teacher
    assert abs(float(kd_transfer(torch.zeros(2, 4), torch.randn(2, 4), 4.0)) - math.log(4)) < 1e-6
    # two classes by hand: teacher logits [0, 8] at T 4 -> softmax([0, 2]); student logits [0, 0] and [1, 0]
    p = torch.tensor([1.0, math.exp(2.0)]) / (1 + math.exp(2.0))
    student = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    logp = torch.log_softmax(student, dim=1)
    want = -float(((p * logp[0]).sum() + (p * logp[1]).sum()) / 2)
    got = kd_transfer(student, torch.tensor([[0.0, 8.0], [0.0, 8.0]]), 4.0)
    assert abs(float(got) - want) < 1e-6
    # the teacher gets no gradient, the student does
    s, t = student.clone().requires_grad_(), torch.tensor([[0.0, 8.0], [0.0, 8.0]], requires_grad=True)
    kd_transfer(s, t, 4.0).backward()
    assert t.grad is None and s.grad is not None


def test_mmd_rbf_by_hand():
    x = torch.randn(5, 3)
    assert abs(float(mmd_rbf(x, x))) < 1e-6  # same samples: no discrepancy
    # one-dimensional, one point each: distances 0 and d^2 = 4; bandwidth = (4 + 4) / 2 / 2^2 = 1;
    # kernels k(0) = 5 and k(4) = sum_i exp(-4 / 2^i); MMD^2 = mean([[5, k], [k, 5]] + ... ) = 2 (5 - k) / 4 * 2
    a, b = torch.tensor([[0.0]]), torch.tensor([[2.0]])
    k = sum(math.exp(-4.0 / 2 ** i) for i in range(5))
    assert abs(float(mmd_rbf(a, b)) - (5 + 5 - k - k)) < 1e-5
    assert float(mmd_rbf(torch.randn(6, 2), torch.randn(6, 2) + 3.0)) > 0


def test_hpm_momentum_grows_with_participation_to_its_cap():
    assert hpm_momentum(0, 10) == 0.0  # first participation: the HPM becomes the local model
    assert abs(hpm_momentum(5, 10) - 0.45) < 1e-12
    assert hpm_momentum(10, 10) == 0.9 and hpm_momentum(30, 10) == 0.9
    assert hpm_momentum(1, 0) == 0.9  # expected count clipped to 1
    assert hpm_momentum(3, 10, mu_max=0.0) == 0.0


def test_hpm_update_and_objective():
    hpm = {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(4)}
    local = {"w": torch.tensor([3.0, 7.0]), "n": torch.tensor(9)}
    out = hpm_update(hpm, local, 0.25)
    assert torch.allclose(out["w"], torch.tensor([2.5, 6.0])) and int(out["n"]) == 9
    assert torch.equal(hpm_update(hpm, local, 0.0)["w"], local["w"])
    assert float(local_objective(torch.tensor(2.0), torch.tensor(10.0), 0.1)) == pytest.approx(0.9 * 2.0 + 0.1 * 10.0)
    assert float(local_objective(torch.tensor(2.0), torch.tensor(10.0), 0.0)) == 2.0
