"""FedPer: the head never leaves a client, stays client-specific, and the bases are FedAvg'd."""
import pytest
import torch
from torch import nn

from pflkit.core import ConfigError, Simulation
from pflkit.core.testing import quick_run, run_capturing_replies, tiny_config
from pflkit_fedper import FedPerTrainer, base_keys


def run_capturing_uploads(tmp_path, algorithm="fedper", sets=()):
    """Run a tiny simulation; return it and every fit reply's uploaded keys."""
    sim = Simulation(tiny_config(algorithm, sets=sets), run_dir=tmp_path / "sim", tensorboard=False)
    captured = run_capturing_replies(sim)
    return sim, [set(r["params"]) for replies in captured.values() for r in replies.values()]


def test_shared_keys_are_exactly_the_features(tmp_path):
    cfg = tiny_config("fedper")
    sim = Simulation(cfg, run_dir=tmp_path / "s", tensorboard=False)
    model = sim.build_model()
    keys = FedPerTrainer.shared_keys(model, sim._trainer_hp)
    assert keys and all(k.startswith("features.") for k in keys)
    assert set(keys) == {k for k in model.state_dict() if k.startswith("features.")}
    assert set(sim.server.global_state) == set(keys)  # the server holds no head


def test_head_never_uploaded_and_stays_personal(tmp_path):
    sim, uploads = run_capturing_uploads(tmp_path)
    assert len(uploads) == 8  # 4 clients x 2 rounds
    assert all(keys and not any(k.startswith("head.") for k in keys) for keys in uploads)
    trainers = sim.backend.trainers
    heads = [trainers[c].model.head.weight.detach() for c in sorted(trainers)]
    assert all(not torch.equal(heads[0], h) for h in heads[1:])  # each client has its own head
    # ...while every client's base is the latest global base (evaluation delivered it)
    for t in trainers.values():
        sd = t.model.state_dict()
        for k, v in sim.server.global_state.items():
            assert torch.equal(sd[k], v)


def test_model_without_head_is_a_clear_error():
    with pytest.raises(ConfigError, match="head"):
        base_keys(nn.Sequential(nn.Linear(3, 2)), ["0.weight", "0.bias"])


def test_quick_run_end_to_end(tmp_path):
    summary = quick_run("fedper", tmp_path)
    fedavg = quick_run("fedavg", tmp_path / "avg")
    assert summary["trainer"] == "fedper" and summary["rounds_completed"] == 2
    assert summary["client_failures"] == 0 and 0.0 <= summary["final"]["uniform"] <= 1.0
    assert summary["bytes_up_total"] < fedavg["bytes_up_total"]  # heads are not communicated


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedper", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
