"""L2GD: step sizes and the averaging pull on hand-made tensors, the lazy averaging steps (communication and
coefficients), scoring after a pending pull keeps nothing, p = 0 = Local bit for bit, pooled = one trainer per
client, resume, bad input, --workers 2 = serial (slow)."""
import os

import pytest
import torch

from pflkit.core import Simulation, evaluate
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_l2gd import (L2GDTrainer, averaging_coefficient, local_step_size, pull_toward,
                         repeated_coefficient)

OVER = {"rounds": 6, "aggregator": {"p": 0.5, "alpha": 0.4, "lam": 2.0}}  # c = 0.4 * 2 / (4 * 0.5) = 0.4


def test_step_sizes_and_pull_on_hand_made_tensors():
    assert local_step_size(1.0, 20, 0.1) == pytest.approx(1 / 18)
    assert averaging_coefficient(1.0, 0.5, 20, 0.1) == pytest.approx(0.25)
    x = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(7)}
    mean = {"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(1)}
    out = pull_toward(x, mean, 0.25)
    assert torch.allclose(out["w"], torch.tensor([0.5, 3.0])) and int(out["n"]) == 7  # int buffers stay
    twice = pull_toward(pull_toward(x, mean, 0.25), mean, 0.25)  # x_bar is unchanged by averaging steps
    assert torch.allclose(twice["w"], pull_toward(x, mean, repeated_coefficient(0.25, 2))["w"])
    assert repeated_coefficient(0.25, 1) == pytest.approx(0.25)


class _Comm:
    """Records what the aggregator sends; clients reply as L2GD clients would (x_i = their id)."""

    def __init__(self):
        self.sent = []

    def send(self, messages, accounted=True):
        self.sent.append({c: (m.kind, dict(m.payload)) for c, m in messages.items()})
        return {c: ({"params": {"w": torch.full((2,), float(c))}, "num_samples": 1} if m.kind == "average"
                    else {"num_samples": 1, "train_loss": 0.0}) for c, m in messages.items()}


def test_averaging_steps_are_lazy_one_upload_per_block_and_the_combined_pull_comes_with_the_next_local_step(
        tmp_path):
    sim = Simulation(tiny_config("l2gd", OVER), run_dir=tmp_path / "r", tensorboard=False)
    agg, comm, clients = sim.server, _Comm(), [0, 1, 2, 3]
    coins = iter([0.1, 0.9, 0.1, 0.1, 0.1, 0.9])  # < p = 0.5 is an averaging step
    agg.ctx.rng = type("R", (), {"random": lambda self: next(coins)})()
    agg.ctx.logger = None
    agg.run_round(1, clients, comm)  # averaging before any local step: every x_i is x^0, nothing to do
    assert comm.sent == [] and agg.mean is None
    agg.run_round(2, clients, comm)  # local step, no pull pending
    assert comm.sent[-1][0] == ("fit", {"lr": local_step_size(0.4, 4, 0.5)})
    agg.run_round(3, clients, comm)  # first averaging step after it: every x_i goes up
    assert [k for k, _ in comm.sent[-1].values()] == ["average"] * 4 and torch.allclose(agg.mean["w"],
                                                                                        torch.full((2,), 1.5))
    agg.run_round(4, clients, comm)
    agg.run_round(5, clients, comm)  # two more averaging steps: no message
    assert len(comm.sent) == 2 and agg.pending == 3
    ev = agg.configure_evaluate(5, clients)[0].payload  # an evaluation scores the pending pull
    assert ev["coef"] == pytest.approx(1 - 0.6 ** 3)
    agg.run_round(6, clients, comm)  # local step: the three pulls combined, then the step
    kind, payload = comm.sent[-1][0]
    assert kind == "fit" and payload["coef"] == pytest.approx(1 - 0.6 ** 3) and agg.pending == 0
    assert agg.configure_evaluate(6, clients)[0].payload == {}


def test_an_evaluation_scores_the_pulled_model_and_keeps_nothing(tmp_path):
    sim = Simulation(tiny_config("l2gd", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = L2GDTrainer(sim.contexts[0])
    trainer.on_fit({"lr": 0.05})
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    mean = {k: torch.zeros_like(v) for k, v in before.items()}
    scored = trainer.on_evaluate({"mean": mean, "coef": 0.5})
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in before.items())
    half = sim.build_model()
    half.load_state_dict(pull_toward(before, mean, 0.5))
    want = evaluate(half, trainer.ctx.test, trainer.ctx.task, sim.cfg.train.eval_batch_size).as_dict()
    assert scored == want and scored != trainer.on_evaluate({})


def test_p_zero_is_local_bit_for_bit(tmp_path):
    # alpha / (n (1 - p)) = 0.2 / 4 = 0.05 = Local's train.lr, exactly
    l2gd, a = tiny_run("l2gd", tmp_path / "l2gd", {"rounds": 3, "aggregator": {"p": 0.0, "alpha": 0.2}})
    local, b = tiny_run("local", tmp_path / "local", {"rounds": 3, "train": {"lr": 0.05}})
    for cid in l2gd.client_ids:
        got, want = l2gd.backend.get_state(cid), local.backend.get_state(cid)
        assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items()), cid
    assert a["final"] == b["final"]
    assert records(tmp_path / "l2gd", drop=("l2gd/", "bytes")) == records(tmp_path / "local", drop=("bytes",))


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("l2gd", OVER, tmp_path)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("l2gd", OVER, tmp_path, stop_after=3)


@pytest.mark.parametrize("sets, message", [
    (("aggregator.p=1",), "aggregator.p: 1.0 is invalid: must be in [0, 1)"),
    (("aggregator.alpha=0",), "aggregator.alpha: 0.0 is invalid"),
    (("aggregator.lam=5",), "aggregator.lam: the averaging coefficient"),
    (("participation.join_ratio=0.5",), "L2GD needs full participation"),
    (("trainer.local_steps=0",), "trainer.local_steps: 0 is invalid"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("l2gd", ("partition.num_clients=4",) + sets, message, tmp_path)


def test_one_stochastic_step_per_local_step(tmp_path):
    sim, _ = tiny_run("l2gd", tmp_path / "r", {"rounds": 1, "aggregator": {"p": 0.0}, "trainer": {"local_steps": 1}})
    epochs, _ = tiny_run("l2gd", tmp_path / "e", {"rounds": 1, "aggregator": {"p": 0.0}})
    one, full = sim.backend.get_state(0)["model"], epochs.backend.get_state(0)["model"]
    assert any(not torch.equal(one[k], full[k]) for k in one)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("l2gd", OVER, tmp_path)


# -- the fedrep_script variant: what FedRep's main_l2gd.py computes (PCFL Table 3's L2GD number) -------------------
def test_script_mean_counts_the_first_client_twice():
    from pflkit_l2gd import script_mean
    mean = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    out = script_mean(mean, {"w": torch.tensor([4.0, 0.0]), "n": torch.tensor(9)}, 2)
    assert torch.allclose(out["w"], torch.tensor([3.0, 2.0])) and int(out["n"]) == 3


class _ScriptComm(_Comm):
    def send(self, messages, accounted=True):
        self.sent.append({c: (m.kind, dict(m.payload)) for c, m in messages.items()})
        out = {}
        for c, m in messages.items():
            x = {"w": torch.full((2,), float(c))}
            out[c] = ({"params": x, "num_samples": 1} if m.kind == "average" else {"own": x} if m.kind == "share"
                      else {"num_samples": 1, "train_loss": 0.0})
        return out


def test_fedrep_script_variant_pulls_by_lr_lambda_and_averages_every_step(tmp_path):
    over = {"rounds": 4, "aggregator": {"p": 0.5, "alpha": 0.4, "lam": 2.0, "variant": "fedrep_script"}}
    sim = Simulation(tiny_config("l2gd", over), run_dir=tmp_path / "r", tensorboard=False)
    agg, comm, clients = sim.server, _ScriptComm(), [0, 1, 2, 3]
    lr = local_step_size(0.4, 4, 0.5)
    assert agg.c == pytest.approx(lr * 2.0)  # the script's lr * lambda, not alpha * lambda / (n p)
    coins = iter([0.9, 0.1, 0.1])
    agg.ctx.rng = type("R", (), {"random": lambda self: next(coins), "choice": lambda self, xs: xs[2]})()
    agg.ctx.logger = None
    agg.run_round(1, clients, comm)  # local step
    agg.run_round(2, clients, comm)  # averaging: every x_i, then client 2 once more; mean = (2 + 0+1+2+3) / 4
    assert [k for k, _ in comm.sent[1].values()] == ["average"] * 4 and comm.sent[2] == {2: ("share", {})}
    assert torch.allclose(agg.mean["w"], torch.full((2,), 2.0)) and agg.pending == 1
    agg.run_round(3, clients, comm)  # a second averaging step collects again, the pending pull coming first
    kinds = comm.sent[3]
    assert all(k == "average" and p["coef"] == pytest.approx(agg.c) for k, p in kinds.values())


def test_fedrep_script_variant_runs_with_its_pull_above_one(tmp_path):
    # two clients, p = 0.9, alpha 1, lambda 0.5 (PCFL Table 3's L2GD): the script's pull lr * lambda is 2.5, which
    # Algorithm 1 never takes (its c = alpha lambda / (n p) = 0.28 here; a c above 1 is refused)
    over = {"rounds": 3, "partition": {"num_clients": 2},
            "aggregator": {"p": 0.9, "alpha": 1.0, "lam": 0.5, "variant": "fedrep_script"}}
    sim, summary = tiny_run("l2gd", tmp_path / "script", over)
    assert sim.server.c == pytest.approx(2.5) and summary["rounds_completed"] == 3
