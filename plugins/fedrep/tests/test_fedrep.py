"""FedRep: head phase leaves the body untouched and vice versa; only the body is uploaded; heads stay personal."""
import json

import pytest
import torch

import pflkit_fedrep
from pflkit.core import ConfigError, Simulation
from pflkit.core.testing import quick_run, run_capturing_replies, tiny_config


def make_sim(tmp_path, sets=()):
    return Simulation(tiny_config("fedrep", sets=sets), run_dir=tmp_path / "sim", tensorboard=False)


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_phases_freeze_the_other_part(tmp_path, monkeypatch):
    sim = make_sim(tmp_path, sets=("trainer.head_epochs=2", "trainer.body_epochs=1"))
    trainer = sim.backend.trainers[0]
    phases = []
    real_run_sgd = pflkit_fedrep.run_sgd

    def recording_run_sgd(batches, loss, opt):
        before = (snapshot(trainer.model.features), snapshot(trainer.model.head))
        trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
        out = real_run_sgd(batches, loss, opt)
        after = (snapshot(trainer.model.features), snapshot(trainer.model.head))
        phases.append({"body_same": same(before[0], after[0]), "head_same": same(before[1], after[1]),
                       "trainable": trainable})
        return out

    monkeypatch.setattr(pflkit_fedrep, "run_sgd", recording_run_sgd)
    reply = trainer.on_fit({"params": sim.server.global_state})
    head_ids = {id(p) for p in trainer.model.head.parameters()}
    body_ids = {id(p) for p in trainer.model.features.parameters()}
    assert len(phases) == 2
    head_phase, body_phase = phases
    assert head_phase["body_same"] and not head_phase["head_same"]
    assert head_phase["trainable"] == head_ids
    assert body_phase["head_same"] and not body_phase["body_same"]
    assert body_phase["trainable"] == body_ids
    assert all(p.requires_grad for p in trainer.model.parameters())  # flags restored
    assert not any(k.startswith("head.") for k in reply["params"])
    assert set(reply["metrics"]) == {"head_loss", "body_loss"}


def test_head_epochs_drive_the_head_phase_length(tmp_path, monkeypatch):
    sim = make_sim(tmp_path, sets=("trainer.head_epochs=3", "train.local_epochs=2"))
    trainer = sim.backend.trainers[2]
    steps = []
    real_run_sgd = pflkit_fedrep.run_sgd

    def counting_run_sgd(batches, loss, opt):
        batches = list(batches)
        steps.append(len(batches))
        return real_run_sgd(batches, loss, opt)

    monkeypatch.setattr(pflkit_fedrep, "run_sgd", counting_run_sgd)
    trainer.on_fit({"params": sim.server.global_state})
    per_epoch = -(-trainer.ctx.num_train // trainer.ctx.train_cfg.batch_size)
    assert steps == [3 * per_epoch, 2 * per_epoch]  # body_epochs defaults to train.local_epochs


def test_only_body_uploaded_and_heads_personal(tmp_path):
    sim = make_sim(tmp_path)
    # the uploads themselves (FedRep's aggregator streams them into one mean: run_capturing_replies keeps them)
    uploads = [set(r["params"]) for replies in run_capturing_replies(sim).values() for r in replies.values()]
    assert uploads and all(keys and all(k.startswith("features.") for k in keys) for keys in uploads)
    heads = [t.model.head.weight.detach() for _, t in sorted(sim.backend.trainers.items())]
    assert all(not torch.equal(heads[0], h) for h in heads[1:])


def test_bad_epochs_rejected():
    with pytest.raises(ConfigError, match="trainer.head_epochs"):
        tiny_config("fedrep", sets=("trainer.head_epochs=0",))


def test_quick_run_end_to_end(tmp_path):
    summary = quick_run("fedrep", tmp_path)
    assert summary["trainer"] == "fedrep" and summary["rounds_completed"] == 2
    assert summary["client_failures"] == 0 and 0.0 <= summary["final"]["uniform"] <= 1.0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln]
    assert any("clients/head_loss" in r for r in rows)


def test_a_model_without_body_is_refused_at_start(tmp_path):
    from pflkit.core.testing import assert_run_refused

    assert_run_refused("fedrep", ["model.name=mlp", "model.hidden=[]"], "FedRep needs a body", tmp_path)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedrep", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
