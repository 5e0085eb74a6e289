"""FedBN: BatchNorm layers (affine + statistics) never leave a client and differ across clients; the rest is
averaged; on a model without BN it is FedAvg."""
import logging

import torch

from pflkit.core import Simulation
from pflkit.core.testing import quick_run, run_capturing_replies, tiny_config
from pflkit_fedbn import FedBNTrainer, local_bn_keys
from pflkit_fedbn.model import BatchNorm1dAnyBatch, fedbn_cnn

TINY_BN = {"model": {"name": "fedbn_cnn", "channels": [4, 4, 8], "hidden": [16]}}


def run_capturing_uploads(tmp_path):
    sim = Simulation(tiny_config("fedbn", TINY_BN), run_dir=tmp_path / "sim", tensorboard=False)
    captured = run_capturing_replies(sim)
    return sim, [set(r["params"]) for replies in captured.values() for r in replies.values()]


def test_local_keys_are_all_bn_state():
    model = fedbn_cnn((1, 8, 8), 10, channels=[4, 4, 8], hidden=[16])
    local = set(local_bn_keys(model))
    bn_modules = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    assert len(bn_modules) == 4
    for name in bn_modules:
        for suffix in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert f"{name}.{suffix}" in local
    shared = FedBNTrainer.shared_keys(model, {})
    assert set(shared) | local == set(model.state_dict()) and not set(shared) & local
    assert "head.weight" in shared and "features.0.weight" in shared  # convs, FCs and head are federated


def test_bn_never_uploaded_and_client_specific(tmp_path):
    sim, uploads = run_capturing_uploads(tmp_path)
    trainers = sim.backend.trainers
    local = set(local_bn_keys(trainers[0].model))
    assert len(uploads) == 8 and all(keys and not keys & local for keys in uploads)
    assert not set(sim.server.global_state) & local
    states = [trainers[c].model.state_dict() for c in sorted(trainers)]
    for key in local:
        if key.endswith("num_batches_tracked"):
            continue
        # every client's BN layer has its own affine parameters and statistics
        assert all(not torch.equal(states[0][key], s[key]) for s in states[1:]), key
    for key, value in sim.server.global_state.items():  # the rest is the common average
        assert all(torch.equal(s[key], value) for s in states), key


def test_without_batchnorm_fedbn_is_fedavg(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        import pflkit_fedbn
        pflkit_fedbn._warned_models.clear()
        fedbn = quick_run("fedbn", tmp_path / "bn", overrides={"model": {"name": "mlp"}}, sets=("train.lr=0.05",))
    assert any("equals FedAvg" in r.getMessage() for r in caplog.records)
    fedavg = quick_run("fedavg", tmp_path / "avg", sets=("train.lr=0.05",))
    assert fedbn["last"] == fedavg["last"] and fedbn["final"] == fedavg["final"]


def test_single_sample_training_batch():
    bn = BatchNorm1dAnyBatch(3).train()
    before = bn.running_mean.clone()
    out = bn(torch.randn(1, 3))
    assert out.shape == (1, 3) and torch.equal(bn.running_mean, before)
    bn(torch.randn(4, 3))
    assert not torch.equal(bn.running_mean, before)


def test_quick_run_end_to_end(tmp_path):
    summary = quick_run("fedbn", tmp_path, overrides=TINY_BN)
    assert summary["trainer"] == "fedbn" and summary["rounds_completed"] == 2
    assert summary["client_failures"] == 0 and 0.0 <= summary["final"]["uniform"] <= 1.0


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedbn", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
