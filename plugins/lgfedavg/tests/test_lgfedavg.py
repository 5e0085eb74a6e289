"""LG-FedAvg: the top layers are shared and the lower ones stay local, sharing every layer is FedAvg bit for bit,
pooled = one trainer per client, resume, two processes = serial, bad input as one line + exit 2."""
import os

import pytest
import torch

from pflkit.core import MODELS
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records, tiny_run)
from pflkit_lgfedavg import LGFedAvgTrainer, model_layers, top_layer_keys

# a 3-layer MLP, so that the default (2 global layers) leaves one local layer
OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}, "model": {"name": "mlp", "hidden": [32, 16]}}


def run(tmp_path, name, algorithm="lgfedavg", sets=(), **kw):
    return tiny_run(algorithm, tmp_path / name, OVER, sets, **kw)


def test_layers_are_counted_from_the_output():
    torch.manual_seed(0)
    cnn = MODELS.get("cnn4")(input_shape=(1, 8, 8), num_classes=10)
    assert [layer[0] for layer in model_layers(cnn)] == ["features.0.weight", "features.3.weight",
                                                        "features.7.weight", "head.weight"]
    # the default, 2: cnn4's 512-wide feature layer and its head; the convolutions stay local
    assert top_layer_keys(cnn, 2) == ["features.7.weight", "features.7.bias", "head.weight", "head.bias"]
    assert top_layer_keys(cnn, 1) == ["head.weight", "head.bias"]  # PFLlib's choice
    res = MODELS.get("resnet8")(input_shape=(3, 8, 8), num_classes=10, width=4)
    layers = model_layers(res)
    assert sum(layers, []) == list(res.state_dict())  # every key in exactly one layer, in order
    assert layers[0] == ["features.0.weight", "features.1.weight", "features.1.bias", "features.1.running_mean",
                         "features.1.running_var", "features.1.num_batches_tracked"]  # a conv with its BatchNorm


def test_top_layers_travel_and_lower_layers_stay_local(tmp_path):
    sim, _ = run(tmp_path, "lg")
    shared = ["features.3.weight", "features.3.bias", "head.weight", "head.bias"]
    assert sorted(sim.server.global_state) == sorted(shared)
    trainer = LGFedAvgTrainer(sim.contexts[0])
    assert trainer.shared == shared and trainer.client_keys() == ["features.1.weight", "features.1.bias"]
    reply = trainer.on_fit({"params": dict(sim.server.global_state)})
    assert sorted(reply["params"]) == sorted(shared)
    # the first layer is each client's own: two clients that trained differ there
    trained = [c for c in sim.client_ids if c in sim.backend.pool.store]
    assert len(trained) >= 2
    firsts = [sim.backend.pool.store.get(c)["model"]["features.1.weight"] for c in trained[:2]]
    assert not torch.equal(*firsts)


def test_sharing_every_layer_is_fedavg_bit_for_bit(tmp_path):
    lg, a = run(tmp_path, "lg", sets=("trainer.global_layers=3",))
    avg, b = run(tmp_path, "avg", "fedavg")
    # the personal numbers; whether a global model is scored depends on the algorithm's declaration, not the layers
    assert records(tmp_path / "lg", drop=("global",)) == records(tmp_path / "avg", drop=("global",))
    assert a["final"] == b["final"]
    for k, v in avg.server.global_state.items():
        assert torch.equal(lg.server.global_state[k], v), k
    _, c = run(tmp_path, "default")
    assert c["final"] != b["final"]


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("lgfedavg", OVER, tmp_path)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("lgfedavg", OVER, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.global_layers=0",), "trainer.global_layers: 0 is invalid: must be > 0"),
    (("trainer.global_layers=5",), "trainer.global_layers: 5 is more than the 4 layers of model SplitModel"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("lgfedavg", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("lgfedavg", OVER, tmp_path)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("lgfedavg", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
