"""FedNTD: beta 0 is FedAvg bit for bit, the distillation target is the received model, declared state (pooled =
one trainer per client), resume, two processes = serial, and bad input as one line + exit 2."""
import os

import pytest
import torch

from pflkit.core import Simulation
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_fedntd import FedNTDTrainer

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def run(tmp_path, name, algorithm="fedntd", sets=(), **kw):
    return tiny_run(algorithm, tmp_path / name, OVER, sets, **kw)


def test_beta_zero_is_fedavg_bit_for_bit(tmp_path):
    ntd, a = run(tmp_path, "ntd", sets=("trainer.beta=0",))
    avg, b = run(tmp_path, "avg", "fedavg")
    assert a["final"] == b["final"] and a["best"] == b["best"]
    # every record equal but the extra metric, whose 8 bytes per reply the upload counter includes
    assert records(tmp_path / "ntd", drop=("ntd_loss", "bytes_up")) == records(tmp_path / "avg", drop=("bytes_up",))
    assert [r["bytes_up"] - 8 * r["clients_replied"] for r in records(tmp_path / "ntd")] == \
        [r["bytes_up"] for r in records(tmp_path / "avg")]
    for k, v in avg.server.global_state.items():
        assert torch.equal(ntd.server.global_state[k], v), k
    # ... while the default beta changes the training
    on, _ = run(tmp_path, "on")
    assert any(not torch.equal(on.server.global_state[k], v) for k, v in avg.server.global_state.items())
    assert all(r["clients/ntd_loss"] > 0 for r in records(tmp_path / "on") if "train_loss" in r)


def test_distillation_target_is_the_received_model_frozen(tmp_path):
    sim = Simulation(tiny_config("fedntd", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = FedNTDTrainer(sim.contexts[1])
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    reply = trainer.on_fit({"params": w_t})
    for k, v in trainer.global_model.state_dict().items():
        assert torch.equal(v, w_t[k]), k  # the frozen copy is w^t, untouched by the local steps
    assert any(not torch.equal(reply["params"][k], w_t[k]) for k in w_t)
    assert not any(p.requires_grad for p in trainer.global_model.parameters())


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("fedntd", OVER, tmp_path)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("fedntd", OVER, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.beta=-1",), "trainer.beta: -1.0 is invalid: must be >= 0"),
    (("trainer.tau=0",), "trainer.tau: 0.0 is invalid: must be > 0"),
    (("dataset.name=pcfl_sine", "model.name=mlp"), "not-true distillation needs a classification task"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedntd", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedntd", OVER, tmp_path)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedntd", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
