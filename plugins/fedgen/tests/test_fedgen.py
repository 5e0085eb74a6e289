"""FedGen: alpha = beta = 0 is FedAvg bit for bit; the generator, trained on the uploaded heads weighted per label,
makes them classify its features as the label and travels from round 2 on; clients upload label counts and add the
regulariser; pooled = one trainer per client, resume (generator and its optimiser), two processes = serial, bad
input as one line + exit 2."""
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from pflkit.core import MODELS, Simulation
from pflkit import core as reg
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 run_capturing_replies, tiny_config, tiny_run, tiny_simulation)
from pflkit_fedgen import FedGenTrainer

# a small generator keeps the tests fast; the defaults are FedSA's 512 / 512
OVER = {"rounds": 3, "participation": {"join_ratio": 0.5},
        "aggregator": {"generator_hidden": 16, "generator_noise": 8, "generator_steps": 5}}
EXTRA = ("fedgen/", "teacher", "latent", "bytes_up", "bytes_down")


def run(tmp_path, name, algorithm="fedgen", sets=(), **kw):
    over = OVER if algorithm == "fedgen" else {k: v for k, v in OVER.items() if k != "aggregator"}
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


def test_regulariser_weight_zero_is_fedavg_bit_for_bit(tmp_path):
    gen, a = run(tmp_path, "gen", sets=("trainer.alpha=0", "trainer.beta=0"))
    avg, b = run(tmp_path, "avg", "fedavg")
    assert a["final"] == b["final"] and a["best"] == b["best"]
    assert records(tmp_path / "gen", drop=EXTRA) == records(tmp_path / "avg", drop=EXTRA)
    for k, v in avg.server.global_state.items():
        assert torch.equal(gen.server.global_state[k], v), k
    on, _ = run(tmp_path, "on")  # the default weights change the training
    assert any(not torch.equal(on.server.global_state[k], v) for k, v in avg.server.global_state.items())


def test_generator_travels_from_round_two_and_clients_upload_label_counts(tmp_path):
    sim = tiny_simulation("fedgen", tmp_path / "r", OVER)
    sent = {}
    original = sim.server.configure_fit
    sim.server.configure_fit = lambda rnd, sel: sent.setdefault(rnd, original(rnd, sel))
    replies = run_capturing_replies(sim)
    assert "generator" not in next(iter(sent[1].values())).payload
    second = next(iter(sent[2].values())).payload
    assert second["round_index"] == 1 and second["labels"] and set(second["labels"]) <= set(range(10))
    assert second["generator"]["hidden.0.weight"].shape == (16, 8 + 10)
    for rnd, by_client in replies.items():
        for cid, reply in by_client.items():
            labels = sim.contexts[cid].train.y
            want = torch.bincount(labels, minlength=10) + 1  # one epoch over the client's data, counts from 1
            assert torch.equal(reply["label_counts"], want), (rnd, cid)
            assert ("metrics" in reply) == (rnd > 1)
    assert sim.server.generator_rounds == 3
    # the label counts pass the privacy guard as ordinary numbers: no reply was refused
    assert all(r["clients_replied"] == r["clients_selected"] and r["client_failures"] == 0
               for r in records(tmp_path / "r"))
    fedavg_down = records(tmp_path / "r")[0]["bytes_down"]
    assert records(tmp_path / "r")[1]["bytes_down"] > fedavg_down  # the generator's bytes are counted


def test_generator_learns_to_make_the_uploaded_heads_classify_its_features(tmp_path):
    sim = tiny_simulation("fedgen", tmp_path / "r", OVER, ("aggregator.generator_steps=150",
                                                            "aggregator.generator_lr=0.01"))
    server = sim.server
    torch.manual_seed(1)
    # two teachers with their own random heads (not the global one), each holding half of the labels
    replies = {}
    for cid, owned in ((0, range(0, 5)), (1, range(5, 10))):
        params = {k: (torch.randn_like(v) if k.startswith("head.") else v.clone())
                  for k, v in server.global_state.items()}
        counts = torch.ones(10, dtype=torch.int64)
        counts[list(owned)] = 50
        replies[cid] = {"params": params, "label_counts": counts, "num_samples": 250}

    def ensemble_accuracy():
        g = server.generator.eval()
        y = torch.arange(10).repeat(20)
        with torch.no_grad():
            z = g(y, g.noise(len(y), torch.Generator().manual_seed(0), torch.device("cpu")))
            # each label judged by the teacher that holds it
            owner = [server._teacher_params(replies[0 if int(t) < 5 else 1]["params"]) for t in y]
            pred = torch.stack([functional_call(server.head, p, (zi[None],))[0] for p, zi in zip(owner, z)])
        return float((pred.argmax(1) == y).float().mean())

    before = ensemble_accuracy()
    server.ctx.rng = np.random.default_rng(0)  # what the run reseeds before every round
    server.train_generator(replies)
    after = ensemble_accuracy()
    assert server.labels == list(range(10)) and after > 0.9 and after > before + 0.3, (before, after)


def test_trainer_adds_the_regulariser_from_the_received_generator(tmp_path):
    sim = Simulation(tiny_config("fedgen", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = FedGenTrainer(sim.contexts[0])
    g = {k: v.clone() for k, v in sim.server.global_state.items()}
    gen = {k: v.clone() for k, v in sim.server.generator.state_dict().items()}
    plain = trainer.on_fit({"params": g})
    assert "metrics" not in plain and trainer.generator is None
    reply = trainer.on_fit({"params": g, "generator": gen, "labels": [0, 3], "round_index": 2})
    m = reply["metrics"]
    assert m["teacher_loss"] > 0 and m["latent_loss"] >= 0
    assert not trainer.generator.training and all(not p.requires_grad for p in trainer.generator.parameters())
    assert trainer.state_dict().keys() == {"model"} and trainer.client_state() == {"model": {}}


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("fedgen", OVER, tmp_path)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("fedgen", OVER, tmp_path)


@pytest.fixture
def plain_model():
    """An in-process model without a features/head split."""
    reg.MODELS.names()
    before = dict(reg.MODELS._entries)
    MODELS.register("plain_seq")(lambda input_shape, num_classes: nn.Sequential(nn.Flatten(),
                                                                                nn.Linear(64, num_classes)))
    yield
    reg.MODELS._entries = before


@pytest.mark.parametrize("sets, message", [
    (("trainer.alpha=-1",), "trainer.alpha: -1.0 is invalid: must be >= 0"),
    (("trainer.gen_batch_size=0",), "trainer.gen_batch_size: 0 is invalid"),
    (("aggregator.generator_hidden=0",), "aggregator.generator_hidden: 0 is invalid"),
    (("aggregator.generator_lr=0",), "aggregator.generator_lr: 0.0 is invalid: must be > 0"),
    (("aggregator.ensemble_eta=-1",), "aggregator.ensemble_eta: -1.0 is invalid"),
    (("model.name=plain_seq",), "no 'features'/'head' split"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, plain_model, sets, message):
    assert_run_refused("fedgen", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedgen", OVER, tmp_path)
