"""FedALA: the ALA rules on hand-made tensors, weights fixed at 1 = FedAvg (and = the wrapped base) bit for bit,
the start phase, what is evaluated, wrapping other algorithms, pooled = one trainer per client, resume, bad input
and --workers 2 = serial (slow)."""
import os

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import Simulation, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, cli, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_fedala import ala_init, ala_step, top_layer_keys
from pflkit_fedala.equations import converged, layer_groups

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def run(tmp_path, name, algorithm="fedala", sets=(), over=OVER, **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- the equations -------------------------------------------------------------------------------------------------
def test_ala_rules_on_hand_made_tensors():
    local, glob = torch.tensor([1.0, 2.0, 0.1]), torch.tensor([3.0, 0.0, 0.7])
    w = torch.tensor([0.25, 1.0, 0.0])
    assert torch.allclose(ala_init(local, glob, w), torch.tensor([1.5, 0.0, 0.1]))  # theta + (Theta - theta) W
    ones = torch.ones(3)
    assert torch.equal(ala_init(local, glob, ones), glob)  # W = 1: Theta, bit for bit
    a, b = torch.tensor([0.3488934636116028]), torch.tensor([1.7539311647415161])  # float32 values where ...
    assert not torch.equal(a + (b - a) * 1.0, b)  # ... the textbook form rounds off Theta
    assert torch.equal(ala_init(a, b, torch.ones(1)), b)
    grad = torch.tensor([0.5, -1.0, 2.0])
    # W - 0.1 * g * (Theta - theta) = [0.25 - 0.1 * 0.5 * 2, 1 - 0.1 * (-1) * (-2), 0 - 0.1 * 2 * 0.6]
    assert torch.allclose(ala_step(w, grad, local, glob, 0.1), torch.tensor([0.15, 0.8, 0.0]))  # clipped at 0
    assert torch.equal(ala_step(w, -10 * grad, local, glob, 1.0), torch.ones(3))  # clipped to [0, 1]
    assert torch.equal(ala_step(w, 10 * grad, local, glob, 1.0), torch.zeros(3))


def test_top_layers_count_modules_not_tensors():
    names = ["features.1.weight", "features.1.bias", "features.3.weight", "head.weight", "head.bias"]
    assert layer_groups(names) == [names[:2], names[2:3], names[3:]]
    assert top_layer_keys(names, 1) == ["head.weight", "head.bias"]  # PFLlib's -p 1 would be head.bias alone
    assert top_layer_keys(names, 2) == ["features.3.weight", "head.weight", "head.bias"]


def test_start_phase_stopping_rule():
    assert not converged([1.0] * 10, 10, 0.1)  # needs more than the window
    assert converged([5.0] + [1.0] * 10, 10, 0.1)
    assert not converged([1.0, 2.0] * 6, 10, 0.1)


# -- the degenerate case --------------------------------------------------------------------------------------------
def test_weights_fixed_at_one_are_fedavg_bit_for_bit(tmp_path):
    ala, _ = run(tmp_path, "ala", sets=("trainer.ala_eta=0",))
    avg, _ = run(tmp_path, "avg", "fedavg")
    for k, v in avg.server.global_state.items():
        assert torch.equal(ala.server.global_state[k], v), k
    assert [r["train_loss"] for r in records(tmp_path / "ala")] == [r["train_loss"] for r in records(tmp_path / "avg")]
    assert any(r.get("clients/ala_weight_mean") == 1.0 for r in records(tmp_path / "ala"))  # ALA did run
    learned, _ = run(tmp_path, "learned")  # ... and learning W changes the training
    assert any(not torch.equal(learned.server.global_state[k], v) for k, v in avg.server.global_state.items())


def test_weights_fixed_at_one_over_a_base_are_that_base(tmp_path):
    ala, _ = run(tmp_path, "ala", sets=("trainer.base=fedprox", "trainer.ala_eta=0", "trainer.mu=0.1"))
    prox, _ = run(tmp_path, "prox", "fedprox", sets=("trainer.mu=0.1",))
    for k, v in prox.server.global_state.items():
        assert torch.equal(ala.server.global_state[k], v), k


# -- ALA's behaviour -------------------------------------------------------------------------------------------------
def test_start_phase_trains_w_to_convergence_once_then_one_epoch(tmp_path):
    sim, _ = run(tmp_path, "r", over={"rounds": 4})  # every client every round
    epochs = [r["clients/ala_epochs"] for r in records(tmp_path / "r")]
    assert epochs[0] == 0  # round 1: no local model yet, ALA skipped
    assert epochs[1] > 1 and epochs[2] == epochs[3] == 1
    for cid in sim.client_ids:
        ala = sim.backend.trainers[cid].state_dict()["ala"]
        assert ala["started"] and ala["has_local"]
        assert sorted(ala["weights"]) == ["head.bias", "head.weight"]  # p = 1 layer: the head's weight and bias
        assert all(float(w.min()) >= 0 and float(w.max()) <= 1 for w in ala["weights"].values())
        assert any(float(w.min()) < 1 for w in ala["weights"].values())  # learned, not left at 1


def test_evaluation_scores_the_local_model(tmp_path):
    from pflkit_fedala import FedAlaTrainer
    from pflkit_fedavg import FedAvgTrainer

    sim = Simulation(tiny_config("fedala", OVER), run_dir=tmp_path / "r", tensorboard=False)
    cls = FedAlaTrainer.wrap(FedAvgTrainer)
    trainer = cls(sim.contexts[1])
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    assert trainer.on_evaluate({"params": w_t}) == trainer.evaluate_model(trainer.model)  # never trained: w^t
    trainer.on_fit({"params": w_t})
    local = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    other = {k: v + 0.5 for k, v in w_t.items()}
    trainer.on_evaluate({"params": other})  # the global model of an evaluate message does not replace theta_i
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in local.items())


def test_fl_show_lists_the_bases_and_a_base_it_cannot_wrap_is_one_line(tmp_path):
    res = CliRunner().invoke(cli, ["show", "fedala"])
    assert res.exit_code == 0
    line = next(ln for ln in res.output.splitlines() if ln.startswith("base algorithms it can wrap"))
    for name in ("fedavg", "fedprox", "ditto", "fedper", "fedrep", "fedrod", "apfl", "pfedme"):
        assert name in line
    assert "pcfl" not in line and " local" not in line
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedala", "--no-progress", "--set", f"output_dir={tmp_path}",
                                   "--set", "trainer.base=pcfl"])
    assert res.exit_code == 2 and "FedAlaTrainer cannot wrap 'pcfl'" in res.output and "fedprox" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("base", ["ditto", "fedrep", "pfedme"])
def test_wraps_other_algorithms(tmp_path, base):
    sim, summary = run(tmp_path, base, sets=(f"trainer.base={base}",))
    assert sim.trainer_cls.__name__.startswith("FedALA[")
    assert summary["rounds_completed"] == 3
    assert any(r.get("clients/ala_epochs", 0) >= 1 for r in records(tmp_path / base))


# -- state -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets", [(), ("trainer.base=ditto",)])
def test_pooled_equals_one_trainer_per_client(tmp_path, sets):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("fedala", OVER, tmp_path, sets)
    for cid in pooled.client_ids:
        want, got = legacy.backend.trainers[cid].state_dict(), pooled.backend.trainers[cid].state_dict()
        assert sorted(got) == sorted(want), cid
        for part in want:
            if part == "ala":
                assert same_state(got[part]["weights"], want[part]["weights"]), cid
                assert (got[part]["started"], got[part]["has_local"]) == (want[part]["started"],
                                                                          want[part]["has_local"])
            else:
                assert same_state(got[part], want[part]), (cid, part)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("fedala", OVER, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.ala_eta=-1",), "trainer.ala_eta: -1.0 is invalid: must be >= 0"),
    (("trainer.ala_percent=0",), "trainer.ala_percent: 0.0 is invalid: must be in (0, 100]"),
    (("trainer.ala_layers=0",), "trainer.ala_layers: 0 is invalid: must be > 0"),
    (("trainer.ala_layers=9",), "trainer.ala_layers: 9 is invalid: the model shares only 4 parameter layers"),
    (("trainer.base=nosuch",), "trainer.base: unknown algorithm 'nosuch'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedala", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedala", OVER, tmp_path)
