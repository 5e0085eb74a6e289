"""train.max_grad_norm: every local step's gradient is clipped to the configured total 2-norm."""
import torch
from easydict import EasyDict

from pflkit.core.testing import quick_run
from pflkit.core.api.training import make_optimizer, run_sgd


def _cfg(**kw):
    base = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "max_grad_norm": None}
    base.update(kw)
    return EasyDict(base)


def _one_step(limit):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer([w], _cfg(max_grad_norm=limit))
    x = torch.tensor([[30.0, 40.0, 0.0]])
    run_sgd([(x, torch.zeros(1))], lambda xb, yb: -(xb @ w).sum(), opt)
    return w.detach()


def test_step_is_clipped_to_the_limit():
    free = _one_step(None)
    assert torch.allclose(free, torch.tensor([30.0, 40.0, 0.0]))  # gradient -x, norm 50, lr 1
    clipped = _one_step(5.0)
    assert abs(float(clipped.norm()) - 5.0) < 1e-5 and torch.allclose(clipped / clipped.norm(), free / free.norm())
    assert torch.equal(_one_step(1000.0), free)  # a limit above the norm changes nothing


def test_runs_with_a_loose_limit_equal_unclipped_runs_and_a_tight_one_differs(tmp_path):
    plain = quick_run("fedavg", tmp_path / "a")
    loose = quick_run("fedavg", tmp_path / "b", sets=("train.max_grad_norm=1e9",))
    tight = quick_run("fedavg", tmp_path / "c", sets=("train.max_grad_norm=0.01",))
    assert loose["final"] == plain["final"]
    assert tight["final"] != plain["final"]
