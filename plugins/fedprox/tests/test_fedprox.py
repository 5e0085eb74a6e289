"""FedProx: the proximal term's gradient, its pull toward the global model, mu=0 == FedAvg, end-to-end run."""
import json
import math

import pytest
import torch

from pflkit.core import ConfigError, Simulation
from pflkit.core.testing import quick_run, tiny_config
from pflkit_fedprox import FedProxTrainer, proximal_term


def make_sim(tmp_path, sets=()):
    cfg = tiny_config("fedprox", sets=sets)
    return Simulation(cfg, run_dir=tmp_path / "sim", tensorboard=False)


def test_proximal_term_value_and_gradient():
    a = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    anchors = [t.detach() + 0.5 for t in a]
    term = proximal_term(a, anchors)
    expected = sum(((t - b) ** 2).sum() for t, b in zip(a, anchors))
    assert torch.allclose(term, expected)
    term.backward()
    for t, b in zip(a, anchors):  # d/dw ||w - w^t||^2 = 2 (w - w^t)
        assert torch.allclose(t.grad, 2 * (t.detach() - b))


def test_loss_gradient_adds_mu_times_distance(tmp_path):
    """grad h_k = grad F_k + mu (w - w^t): the extra gradient points from w^t to w, so SGD pulls w back."""
    sim = make_sim(tmp_path, sets=("trainer.mu=0.7",))
    trainer = sim.backend.trainers[0]
    assert isinstance(trainer, FedProxTrainer)
    trainer.receive(sim.server.global_state)
    with torch.no_grad():  # move away from w^t
        for p in trainer.model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, y = trainer.ctx.train.all()

    def grads(mu):
        trainer.ctx.hp.mu = mu
        trainer.model.zero_grad()
        trainer.loss(x, y).backward()
        return [p.grad.clone() for p in trainer.model.parameters()]

    g_prox, g_plain = grads(0.7), grads(0.0)
    for gp, g0, p, w_t in zip(g_prox, g_plain, trainer.model.parameters(), trainer._anchor):
        assert torch.allclose(gp - g0, 0.7 * (p.detach() - w_t), atol=1e-6)


def test_larger_mu_keeps_local_model_closer_to_global(tmp_path):
    sim = make_sim(tmp_path, sets=("train.lr=0.1", "train.local_epochs=3"))
    trainer = sim.backend.trainers[1]
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    distances = {}
    for mu in (0.0, 1.0, 5.0):
        trainer.model.load_state_dict(start)
        trainer.ctx.hp.mu = mu
        trainer.ctx.generator.manual_seed(0)
        torch.manual_seed(0)
        reply = trainer.on_fit({"params": sim.server.global_state})
        distances[mu] = reply["metrics"]["distance_to_global"]
    assert distances[0.0] > distances[1.0] > distances[5.0] > 0


def test_mu_zero_equals_fedavg_exactly(tmp_path):
    prox = quick_run("fedprox", tmp_path / "prox", sets=("trainer.mu=0",))
    avg = quick_run("fedavg", tmp_path / "avg")
    assert prox["last"] == avg["last"]
    assert prox["final"] == avg["final"]
    # and a positive mu does change the run
    prox1 = quick_run("fedprox", tmp_path / "prox1", sets=("trainer.mu=1.0",))
    assert prox1["last"] != avg["last"]


def test_negative_mu_is_rejected():
    with pytest.raises(ConfigError, match="trainer.mu"):
        tiny_config("fedprox", sets=("trainer.mu=-1",))


def test_quick_run_end_to_end(tmp_path):
    summary = quick_run("fedprox", tmp_path)
    assert summary["trainer"] == "fedprox" and summary["aggregator"] == "fedavg"
    assert summary["rounds_completed"] == 2 and summary["client_failures"] == 0
    assert 0.0 <= summary["final"]["uniform"] <= 1.0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln]
    assert all(math.isfinite(r["clients/distance_to_global"]) and r["clients/distance_to_global"] > 0
               for r in rows if "train_loss" in r)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedprox", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
