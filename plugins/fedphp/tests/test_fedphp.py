"""FedPHP: lambda 0 trains as FedAvg bit for bit; the HPM follows the moving-average rule and is what is scored;
pooled = one trainer per client, resume, two processes = serial, bad input as one line + exit 2."""
import os

import pytest
import torch
from torch import nn

from pflkit.core import MODELS, Simulation
from pflkit import core as reg
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 run_capturing_replies, tiny_config, tiny_run, tiny_simulation)
from pflkit_fedphp import FedPHPTrainer, expected_participations

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}
EVAL = ("accuracy", "per_client", "test_loss", "transfer", "hpm", "bytes_up", "bytes_down", "global")


def run(tmp_path, name, algorithm="fedphp", sets=(), **kw):
    return tiny_run(algorithm, tmp_path / name, OVER, sets, **kw)


def test_lambda_zero_trains_as_fedavg_bit_for_bit_and_mu_zero_keeps_the_last_local_model(tmp_path):
    php = tiny_simulation("fedphp", tmp_path / "php", OVER, ("trainer.lam=0", "trainer.mu_max=0"))
    replies = run_capturing_replies(php)
    avg, _ = run(tmp_path, "avg", "fedavg")
    # same global models and training losses; only what is scored (the HPM) and the extra reply fields differ
    for k, v in avg.server.global_state.items():
        assert torch.equal(php.server.global_state[k], v), k
    assert records(tmp_path / "php", drop=EVAL) == records(tmp_path / "avg", drop=EVAL)
    # mu 0: each client's HPM is its last uploaded local model
    for cid in php.client_ids:
        last = max(r for r in replies if cid in replies[r])
        hpm = php.backend.trainers[cid].state_dict()["hpm"]
        assert all(torch.equal(hpm[k], v) for k, v in replies[last][cid]["params"].items()), cid
    on, _ = run(tmp_path, "on")  # the default lambda changes the training
    assert any(not torch.equal(on.server.global_state[k], v) for k, v in avg.server.global_state.items())


@pytest.mark.parametrize("transfer", ["kd", "mmd"])
def test_hpm_is_the_moving_average_of_the_local_models_and_is_scored(tmp_path, transfer):
    sim = Simulation(tiny_config("fedphp", OVER, (f"trainer.transfer={transfer}",)), run_dir=tmp_path / "r",
                     tensorboard=False)
    trainer = FedPHPTrainer(sim.contexts[0])
    w0 = sim.build_model().state_dict()
    assert all(torch.equal(v, w0[k]) for k, v in trainer.hpm.state_dict().items())  # w^0 before the first fit
    g = {k: v.clone() for k, v in sim.server.global_state.items()}
    expected = expected_participations(0.5, 3)  # floor(0.5 * 3) = 1
    first = trainer.on_fit({"params": g, "expected_participations": expected})
    assert first["metrics"]["hpm_mu"] == 0.0 and trainer.participations == 1 and first["metrics"]["transfer_loss"] > 0
    assert all(torch.equal(trainer.hpm.state_dict()[k], v) for k, v in first["params"].items())
    old = {k: v.clone() for k, v in trainer.hpm.state_dict().items()}
    second = trainer.on_fit({"params": g, "expected_participations": 4})
    mu = second["metrics"]["hpm_mu"]
    assert mu == pytest.approx(0.9 / 4) and trainer.participations == 2
    for k, v in second["params"].items():
        assert torch.allclose(trainer.hpm.state_dict()[k], mu * old[k] + (1 - mu) * v, atol=1e-7), k
    assert trainer.personal_forward() is trainer.hpm  # the HPM is evaluated, not the received global model
    state = trainer.client_state()
    assert state["participations"] == 2 and sorted(state["hpm"]) == sorted(w0) and state["model"] == {}
    with pytest.raises(RuntimeError, match="expected_participations"):
        trainer.on_fit({"params": g})


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("fedphp", OVER, tmp_path)
    for cid in pooled.client_ids:
        want, got = legacy.backend.trainers[cid].state_dict(), pooled.backend.trainers[cid].state_dict()
        assert want["participations"] == got["participations"]
        assert all(torch.equal(got["hpm"][k], v) for k, v in want["hpm"].items()), cid


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("fedphp", OVER, tmp_path, sets=("trainer.transfer=mmd",))


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
    (("trainer.lam=1.5",), "trainer.lam: 1.5 is invalid"),
    (("trainer.mu_max=-0.1",), "trainer.mu_max: -0.1 is invalid"),
    (("trainer.temperature=0",), "trainer.temperature: 0.0 is invalid: must be > 0"),
    (("trainer.transfer=l2",), "trainer.transfer"),
    (("trainer.transfer=mmd", "model.name=plain_seq"), "has no 'features'/'head'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, plain_model, sets, message):
    assert_run_refused("fedphp", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedphp", OVER, tmp_path)


def test_spilled_hpms_give_the_same_numbers(tmp_path):
    _, kept = run(tmp_path, "kept")
    sim, spilled = run(tmp_path, "spilled", sets=("clients.state_memory=1",))  # every HPM goes to disk
    assert sim.backend.pool.store.spills > 0  # spilled during the run; the files go at a clean finish
    assert not (tmp_path / "spilled" / "client_state").exists()
    assert records(tmp_path / "spilled") == records(tmp_path / "kept") and spilled["final"] == kept["final"]
