"""Ditto: personal model differs from the global one, lambda pulls it toward w^t, evaluation scores it."""
import json

import pytest
import torch

from pflkit.core import ConfigError, Simulation
from pflkit.core.testing import quick_run, tiny_config
from pflkit_ditto import DittoTrainer


def make_sim(tmp_path, sets=()):
    return Simulation(tiny_config("ditto", sets=sets), run_dir=tmp_path / "sim", tensorboard=False)


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_personal_model_differs_from_global_and_is_evaluated(tmp_path):
    sim = make_sim(tmp_path)
    sim.run()
    trainer = sim.backend.trainers[0]
    assert isinstance(trainer, DittoTrainer)
    assert not torch.equal(flat(trainer.personal), flat(trainer.model))
    # the global copy on the client is the server's latest model (delivered for evaluation) ...
    for k, v in sim.server.global_state.items():
        assert torch.equal(trainer.model.state_dict()[k], v)
    # ... but the score a client reports is its personal model's
    reported = trainer.on_evaluate({"params": sim.server.global_state})
    assert reported == trainer.evaluate_model(trainer.personal)
    assert reported != trainer.evaluate_model(trainer.model)


def test_larger_lambda_pulls_personal_toward_global(tmp_path):
    sim = make_sim(tmp_path, sets=("train.local_epochs=3",))
    trainer = sim.backend.trainers[1]
    # a personal model far from w^t, as after rounds of local drift
    with torch.no_grad():
        for p in trainer.personal.parameters():
            p.add_(0.2 * torch.randn_like(p))
        start = {k: v.clone() for k, v in trainer.personal.state_dict().items()}
    distances = {}
    for lam in (0.0, 1.0, 10.0):
        trainer.personal.load_state_dict(start)
        trainer.ctx.hp.lam = lam
        trainer.receive(sim.server.global_state)
        trainer.ctx.generator.manual_seed(0)
        torch.manual_seed(0)
        distances[lam] = trainer.personal_update()["personal_to_global"]
    assert distances[0.0] > distances[1.0] > distances[10.0]
    assert distances[10.0] < 0.5 * distances[0.0]


def test_personal_update_uses_received_global_not_updated_one(tmp_path):
    sim = make_sim(tmp_path, sets=("trainer.lam=5.0",))
    trainer = sim.backend.trainers[2]
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    reply = trainer.on_fit({"params": w_t})
    # the reported distance is to w^t: recompute it from the personal model and w^t
    dist = torch.sqrt(sum(((p.detach() - w_t[n]) ** 2).sum() for n, p in trainer.personal.named_parameters()))
    assert reply["metrics"]["personal_to_global"] == pytest.approx(float(dist), rel=1e-5)
    assert set(reply["params"]) == set(w_t)  # the whole global model is uploaded
    assert any(not torch.equal(reply["params"][k], w_t[k]) for k in w_t)  # ... after FedAvg's local update


def test_checkpoint_state_keeps_personal_model(tmp_path):
    sim = make_sim(tmp_path)
    sim.run()
    trainer = sim.backend.trainers[3]
    state = trainer.state_dict()
    fresh = DittoTrainer(trainer.ctx)
    fresh.load_state_dict(state)
    assert torch.equal(flat(fresh.personal), flat(trainer.personal))


def test_negative_lambda_rejected():
    with pytest.raises(ConfigError, match="trainer.lam"):
        tiny_config("ditto", sets=("trainer.lam=-0.1",))


def test_quick_run_end_to_end(tmp_path):
    summary = quick_run("ditto", tmp_path)
    assert summary["trainer"] == "ditto" and summary["aggregator"] == "fedavg"
    assert summary["rounds_completed"] == 2 and summary["client_failures"] == 0
    assert 0.0 <= summary["final"]["uniform"] <= 1.0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln]
    assert all(r["clients/personal_to_global"] > 0 for r in rows if "train_loss" in r)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("ditto", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
