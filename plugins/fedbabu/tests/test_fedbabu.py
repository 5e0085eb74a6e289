"""FedBABU: body-only FedAvg with the head frozen at its initialisation (bit for bit), fine-tuning a scratch copy at
evaluation without touching training, pooled = one trainer per client, resume, two processes = serial, bad input."""
import os

import pytest
import torch
from torch import nn

from pflkit.core import MODELS, TRAINERS, make_optimizer, run_sgd, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 run_capturing_replies, tiny_config, tiny_simulation)
from pflkit_fedavg import FedAvgTrainer
from pflkit_fedbabu import FedBABUTrainer

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}
FT = ("eval.adapt_epochs=1",)  # one fine-tuning epoch keeps the tests fast


class BodyOnlyFedAvg(FedAvgTrainer):
    """The reference: FedAvg that shares the body only and whose optimiser holds the body only (head lr 0)."""

    @classmethod
    def shared_keys(cls, model, hp):
        return [k for k in super().shared_keys(model, hp) if not k.startswith("head.")]

    def local_update(self):
        self.model.train()
        return run_sgd(self.batches(), self.loss,
                       make_optimizer(self.model.features.parameters(), self.ctx.train_cfg))


def _no_head(input_shape, num_classes, **_):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


@pytest.fixture
def registered():
    """Register the test's trainer and model in this process, and forget them afterwards."""
    from pflkit import core as reg

    for r in reg.ALL_REGISTRIES.values():
        r._discover()
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items()}
    TRAINERS.register("fedbabu_test_body_only", BodyOnlyFedAvg)
    MODELS.register("fedbabu_test_nohead", _no_head)
    yield
    for k, r in reg.ALL_REGISTRIES.items():
        r._entries = before[k]


def simulation(tmp_path, name, algorithm="fedbabu", sets=FT, **kw):
    return tiny_simulation(algorithm, tmp_path / name, OVER, sets, **kw)


def test_without_fine_tuning_it_is_body_only_fedavg_with_a_frozen_head(tmp_path, registered):
    babu = simulation(tmp_path, "babu", sets=("eval.adapt=never",))
    got = run_capturing_replies(babu)
    ref = simulation(tmp_path, "ref", "fedavg", sets=("trainer.name=fedbabu_test_body_only",))
    want = run_capturing_replies(ref)
    assert records(tmp_path / "babu") == records(tmp_path / "ref")
    for rnd in want:  # every upload, bit for bit: the body only
        for cid in want[rnd]:
            assert same_state(got[rnd][cid]["params"], want[rnd][cid]["params"])
            assert not any(k.startswith("head.") for k in got[rnd][cid]["params"])
    head0 = babu.build_model().head.state_dict()
    for cid in babu.client_ids:  # the head never moved from the common random initialisation
        trainer = babu.backend.trainers[cid]
        assert same_state(trainer.model.head.state_dict(), head0)
        assert not any(p.requires_grad for p in trainer.model.head.parameters())
    assert set(babu.server.global_state) == {k for k in babu.build_model().state_dict() if k.startswith("features.")}


def test_fine_tuning_at_evaluation_changes_scores_not_training(tmp_path):
    plain = simulation(tmp_path, "plain", sets=("eval.adapt=never",))
    plain_up = run_capturing_replies(plain)
    tuned = simulation(tmp_path, "tuned")
    tuned_up = run_capturing_replies(tuned)
    for rnd in plain_up:
        for cid in plain_up[rnd]:
            assert same_state(tuned_up[rnd][cid]["params"], plain_up[rnd][cid]["params"])
    a, b = records(tmp_path / "tuned"), records(tmp_path / "plain")
    steps = sum(-(-len(tuned.data.splits[c].train) // 32) for c in tuned.client_ids)  # one epoch, batch 32
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == rb["train_loss"]
        assert ra["accuracy/uniform"] > rb["accuracy/uniform"]  # a random head scores poorly until fine-tuned
        assert ra["adapt/steps"] == steps and ra["adapt/clients"] == 4
    assert tuned.cfg.eval.adapt_params == "all"


def test_fedbabu_defaults_are_the_papers_protocol():
    cfg = tiny_config("fedbabu")
    assert (cfg.eval.adapt, cfg.eval.adapt_epochs, cfg.eval.adapt_steps, cfg.eval.adapt_params) == \
        ("every", 5, None, "all")
    assert cfg.aggregator.weighting == "samples"


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, _ = assert_pooled_matches_one_trainer_per_client("fedbabu", OVER, tmp_path, FT)
    assert len(pooled.backend.pool.store) == 0  # the frozen head equals the initial state: nothing is stored


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("fedbabu", OVER, tmp_path, FT)


@pytest.mark.parametrize("sets, message", [
    (("model.name=fedbabu_test_nohead",), "has no 'head' sub-module"),
    (("eval.adapt_steps=3",), "eval.adapt_steps (3) and eval.adapt_epochs (5) are both set"),
    (("eval.adapt_params=tail",), "eval.adapt_params: 'tail' is not a parameter set of trainer 'fedbabu'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message, registered):
    assert_run_refused("fedbabu", sets, message, tmp_path, strict=True)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedbabu", OVER, tmp_path, FT)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedbabu", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
