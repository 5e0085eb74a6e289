"""MOON: mu 0 is FedAvg bit for bit (same model), the previous model is the client's last trained one (w^0 before),
only its representation part is kept, pooled = one trainer per client, resume, two processes = serial, bad input
as one line + exit 2."""
import math
import os

import pytest
import torch
from torch import nn

from pflkit.core import MODELS, Simulation
from pflkit import core as reg
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_moon import MOONTrainer

# the tiny MLP with MOON's projection head (8 wide here), so the contrasted z is the projection's output
OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}, "model": {"name": "mlp", "hidden": [32],
                                                                       "projection_dim": 8}}


def run(tmp_path, name, algorithm="moon", sets=(), **kw):
    return tiny_run(algorithm, tmp_path / name, OVER, sets, **kw)


def test_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    moon, a = run(tmp_path, "moon", sets=("trainer.mu=0",))
    avg, b = run(tmp_path, "avg", "fedavg")
    assert a["final"] == b["final"] and a["best"] == b["best"]
    # every record equal but the extra metric, whose 8 bytes per reply the upload counter includes
    assert records(tmp_path / "moon", drop=("contrastive", "bytes_up")) == records(tmp_path / "avg", drop=("bytes_up",))
    assert [r["bytes_up"] - 8 * r["clients_replied"] for r in records(tmp_path / "moon")] == \
        [r["bytes_up"] for r in records(tmp_path / "avg")]
    for k, v in avg.server.global_state.items():
        assert torch.equal(moon.server.global_state[k], v), k
    on, _ = run(tmp_path, "on")  # the default mu changes the training
    assert any(not torch.equal(on.server.global_state[k], v) for k, v in avg.server.global_state.items())


def test_previous_model_is_the_last_trained_one_and_only_its_representation_is_kept(tmp_path):
    sim = Simulation(tiny_config("moon", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = MOONTrainer(sim.contexts[0])
    w0 = sim.build_model()
    assert all(torch.equal(v, w0.features.state_dict()[k]) for k, v in trainer.previous.state_dict().items())
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    reply = trainer.on_fit({"params": w_t})
    trained = trainer.model.features.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in trainer.previous.state_dict().items())
    assert all(torch.equal(v, w_t["features." + k]) for k, v in trainer.global_features.state_dict().items())
    assert any(not torch.equal(reply["params"][k], w_t[k]) for k in w_t)
    state = trainer.client_state()
    assert sorted(state["previous"]) == sorted(trained)  # features only: the head is never needed
    assert state["model"] == {}  # FedAvg's part: every key is shared, nothing else is kept
    # a previous model equal to w^t: z_glob = z_prev, so l_con = log 2 at every step, whatever z is
    trainer.previous.load_state_dict(trainer.global_features.state_dict())
    load = trainer.on_fit({"params": w_t})["metrics"]["contrastive_loss"]
    assert abs(load - math.log(2)) < 1e-6


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("moon", OVER, tmp_path)
    for cid in pooled.client_ids:  # the kept previous models, bit for bit
        want = legacy.backend.trainers[cid].previous.state_dict()
        got = pooled.backend.trainers[cid].state_dict()["previous"]
        assert all(torch.equal(got[k], v) for k, v in want.items()), cid


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("moon", OVER, tmp_path)


@pytest.fixture
def plain_model():
    """An in-process model without a features/head split."""
    reg.MODELS.names()  # loads the entry points first, so the snapshot holds them
    before = dict(reg.MODELS._entries)
    MODELS.register("plain_seq")(lambda input_shape, num_classes: nn.Sequential(nn.Flatten(),
                                                                                nn.Linear(64, num_classes)))
    yield
    reg.MODELS._entries = before


@pytest.mark.parametrize("sets, message", [
    (("trainer.mu=-1",), "trainer.mu: -1.0 is invalid: must be >= 0"),
    (("trainer.tau=0",), "trainer.tau: 0.0 is invalid: must be > 0"),
    (("model.projection_dim=-2",), "model.projection_dim: -2 is invalid: must be >= 0"),
    (("model.name=plain_seq",), "MOON contrasts the representation features(x)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, plain_model, sets, message):
    assert_run_refused("moon", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("moon", OVER, tmp_path)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("moon", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
