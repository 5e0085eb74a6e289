"""FedProto client and server: only prototypes travel, their byte count, partial participation, resume, CLI."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from easydict import EasyDict
from torch import nn

from pflkit.core import (ClientContext, ConfigError, Message, PflError, ServerContext, Simulation, SplitModel,
                         TensorData, classification, iter_tensors)
from pflkit.core.testing import cli, quick_run, run_capturing_replies, tiny_config
from pflkit_fedproto import FedProtoAggregator, FedProtoTrainer
from pflkit_fedproto.equations import local_prototypes, prototype_scores

TRAIN_CFG = EasyDict(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=8, local_epochs=2,
                     eval_batch_size=64)
HP = dict(lambda_proto=1.0, proto_distance="mean", prototypes_from="trained", inference="prototype")
AGG_HP = dict(weighting="samples", absent_classes="keep")


def small_model() -> SplitModel:
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 3), 8)


def make_client(cid: int = 0, train_cfg=TRAIN_CFG, **hp) -> FedProtoTrainer:
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(30, 6, generator=g) + cid
    y = torch.randint(0, 2, (30,), generator=g)  # class 2 absent from every client
    data = TensorData(x, y)
    ctx = ClientContext(cid=cid, train=data, test=data, task=classification(3), device=torch.device("cpu"),
                        hp=EasyDict({**HP, **hp}), train_cfg=train_cfg, build_model=small_model, num_clients=3,
                        seed=0)
    ctx.generator.manual_seed(7)
    return FedProtoTrainer(ctx)


def make_server(**hp) -> FedProtoAggregator:
    ctx = ServerContext(hp=EasyDict({**AGG_HP, **hp}), cfg=EasyDict(), task=classification(3), num_clients=3,
                        build_model=small_model, shared_keys=None, device=torch.device("cpu"), seed=0, logger=None,
                        rng=np.random.default_rng(0))
    return FedProtoAggregator(ctx)


# -- client ------------------------------------------------------------------------------------------------------
def test_upload_is_the_class_means_of_the_trained_model_and_nothing_else():
    client = make_client()
    reply = client.on_fit({})
    assert set(reply) == {"prototypes", "classes", "class_counts", "num_samples", "train_loss", "metrics"}
    x, y = client.ctx.train.all()
    with torch.no_grad():
        z = client.model.features(x)
    assert reply["classes"].tolist() == [0, 1]  # only the classes this client holds
    assert reply["class_counts"].tolist() == torch.bincount(y, minlength=2).tolist()
    expected = torch.stack([z[y == c].mean(0) for c in (0, 1)])
    assert torch.allclose(reply["prototypes"], expected, atol=1e-6)
    assert reply["metrics"]["proto_loss"] == 0.0  # no global prototypes yet: CE only
    assert set(client.state_dict()) == {"model"}


def test_regulariser_pulls_embeddings_to_the_global_prototypes():
    glob = {"prototypes": torch.zeros(2, 8), "classes": torch.tensor([0, 1])}

    def mean_sq_dist(client):
        x, y = client.ctx.train.all()
        with torch.no_grad():
            return float((client.model.features(x) ** 2).sum(1).mean())

    free, pulled = make_client(lambda_proto=0.0), make_client(lambda_proto=5.0)
    r_free, r_pulled = free.on_fit(glob), pulled.on_fit(glob)
    assert r_free["metrics"]["proto_loss"] > 0 and r_pulled["metrics"]["proto_loss"] > 0
    assert r_pulled["train_loss"] == pytest.approx(r_pulled["metrics"]["ce_loss"] +
                                                   5.0 * r_pulled["metrics"]["proto_loss"], rel=1e-5)
    assert r_free["train_loss"] == pytest.approx(r_free["metrics"]["ce_loss"], rel=1e-6)
    assert mean_sq_dist(pulled) < 0.5 * mean_sq_dist(free)


def test_last_epoch_prototypes_collect_one_epoch_of_training_embeddings():
    # with lr -> 0 the model does not move, so the last epoch's embeddings are the trained model's: same means,
    # and the counts are one epoch's (not local_epochs x the data)
    frozen_cfg = EasyDict({**TRAIN_CFG, "lr": 1e-12})
    seen = make_client(train_cfg=frozen_cfg, prototypes_from="last_epoch").on_fit({})
    after = make_client(train_cfg=frozen_cfg).on_fit({})
    assert seen["class_counts"].tolist() == after["class_counts"].tolist()
    assert torch.allclose(seen["prototypes"], after["prototypes"], atol=1e-5)
    moving = make_client(prototypes_from="last_epoch").on_fit({})
    assert not torch.allclose(moving["prototypes"], make_client().on_fit({})["prototypes"], atol=1e-3)


def test_inference_by_nearest_prototype_or_classifier():
    client = make_client()
    client.on_fit({})
    glob_rows = torch.tensor([[0.0] * 8, [1.0] * 8, [5.0] * 8])
    payload = {"prototypes": glob_rows, "classes": torch.tensor([0, 1, 2])}
    x, y = client.ctx.test.all()
    with torch.no_grad():
        z = client.model.features(x)
        nearest = torch.cdist(z, glob_rows).argmin(1)
        logits = client.model(x)
    assert client.on_evaluate(payload)["metric_sum"] == float((nearest == y).sum())
    client.ctx.hp.inference = "classifier"
    assert client.on_evaluate(payload)["metric_sum"] == float((logits.argmax(1) == y).sum())
    client.ctx.hp.inference = "prototype"
    assert client.on_evaluate({})["metric_sum"] == float((logits.argmax(1) == y).sum())  # no prototypes yet


def test_client_without_training_data_uploads_no_prototype():
    client = make_client()
    client.ctx.train = TensorData(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))
    reply = client.on_fit({})
    assert reply["prototypes"].shape == (0, 8) and reply["classes"].numel() == 0
    server = make_server()
    server.aggregate_fit(1, {0: reply, 1: make_client(1).on_fit({})})
    assert server.present.tolist() == [True, True, False]


def test_malformed_prototype_message_is_refused():
    client = make_client()
    with pytest.raises(PflError, match="0..2"):
        client.on_fit({"prototypes": torch.zeros(1, 8), "classes": torch.tensor([7])})


def test_model_without_head_is_a_config_error():
    ctx = make_client().ctx
    ctx.build_model = lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, 3))
    with pytest.raises(ConfigError, match="feature-extractor / head split"):
        FedProtoTrainer(ctx)


# -- server ------------------------------------------------------------------------------------------------------
def _reply(classes, rows, counts):
    return {"prototypes": torch.tensor(rows, dtype=torch.float32).repeat_interleave(4, dim=1),
            "classes": torch.tensor(classes), "class_counts": torch.tensor(counts), "num_samples": sum(counts),
            "train_loss": 0.0}


def test_server_aggregates_by_class_counts_and_sends_only_defined_prototypes():
    server = make_server()
    assert server.configure_fit(1, [0, 1])[0].payload == {}  # round 1: nothing to send
    replies = {0: _reply([0, 1], [[1.0, 1.0], [2.0, 0.0]], [1, 3]), 1: _reply([0], [[4.0, 1.0]], [3])}
    assert server.aggregate_fit(1, replies) is None
    assert torch.allclose(server.prototypes[0], torch.tensor([13 / 4] * 4 + [1.0] * 4))
    assert server.present.tolist() == [True, True, False]
    msg = server.configure_fit(2, [2])[2]
    assert msg.kind == "fit" and msg.payload["classes"].tolist() == [0, 1]
    assert msg.payload["prototypes"].shape == (2, 8)
    ev = server.configure_evaluate(2, [0, 1, 2])
    assert sorted(ev) == [0, 1, 2] and all(m.kind == "evaluate" for m in ev.values())
    uniform = make_server(weighting="uniform")
    uniform.aggregate_fit(1, replies)
    assert torch.allclose(uniform.prototypes[0], torch.tensor([2.5] * 4 + [1.0] * 4))


def test_partial_participation_keeps_or_drops_absent_classes():
    first = {0: _reply([0, 1], [[1.0, 1.0], [2.0, 0.0]], [1, 3])}
    later = {1: _reply([0], [[4.0, 1.0]], [3])}  # client 0 absent: nobody reports class 1
    keep, drop = make_server(), make_server(absent_classes="drop")
    for s in (keep, drop):
        s.aggregate_fit(1, first)
        s.aggregate_fit(2, later)
        assert torch.allclose(s.prototypes[0], torch.tensor([4.0] * 4 + [1.0] * 4))  # only this round's uploads
    assert keep.present.tolist() == [True, True, False]
    assert torch.allclose(keep.prototypes[1], torch.tensor([2.0] * 4 + [0.0] * 4))
    assert drop.present.tolist() == [True, False, False]
    assert keep.aggregate_fit(3, {}) is None


def test_server_refuses_a_malformed_upload():
    bad = _reply([0], [[1.0, 1.0]], [2])
    bad["prototypes"] = torch.zeros(1, 5)
    with pytest.raises(PflError, match="expected \\(k, 8\\)"):
        make_server().aggregate_fit(1, {0: bad})


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="trainer.lambda_proto"):
        tiny_config("fedproto", sets=("trainer.lambda_proto=-0.5",))
    with pytest.raises(ConfigError, match="aggregator.weighting"):
        tiny_config("fedproto", sets=("aggregator.weighting=median",))


def test_every_option_value_can_be_set_from_the_command_line():
    for section, cls in (("trainer", FedProtoTrainer), ("aggregator", FedProtoAggregator)):
        for key, param in cls.params.items():
            for value in param.choices or ():
                assert tiny_config("fedproto", sets=(f"{section}.{key}={value}",))[section][key] == value


def test_defaults_follow_the_authors_settings():
    from pflkit.core.testing import resolve
    cfg = resolve([], algorithm="fedproto")
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.momentum) == ("sgd", 0.01, 0.5)
    assert (cfg.train.batch_size, cfg.train.local_epochs, cfg.trainer.lambda_proto) == (4, 1, 1.0)
    assert cfg.trainer.inference == "prototype" and cfg.aggregator.weighting == "samples"


# -- runs --------------------------------------------------------------------------------------------------------
def test_only_prototypes_travel_and_the_byte_count_is_exact(tmp_path):
    sim = Simulation(tiny_config("fedproto", sets=("rounds=3",)), run_dir=tmp_path / "run", tensorboard=False)
    captured = run_capturing_replies(sim)
    summary = sim.summary()
    model = sim.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    d = model.feature_dim
    held = {c: int(torch.unique(sim.contexts[c].train.y).numel()) for c in sim.client_ids}
    for replies in captured.values():
        for cid, reply in replies.items():
            assert set(reply) == {"prototypes", "classes", "class_counts", "num_samples", "train_loss", "metrics"}
            assert reply["prototypes"].shape == (held[cid], d)
            assert sum(t.numel() for t in iter_tensors(reply)) < n_params / 5  # far less than a model
    params = [p for t in sim.backend.trainers.values() for p in t.model.parameters()]
    last = captured[3]
    for reply in last.values():  # and no tensor of the last round is a (trained) model parameter
        assert not any(t.shape == p.shape and torch.equal(t, p.detach()) for t in iter_tensors(reply) for p in params)
    # up, per client and round: k prototypes (4 bytes/entry), k class ids and k counts (8 bytes each), and four
    # scalars (num_samples, train_loss, 2 metrics). down: nothing in round 1, then the defined global prototypes
    # (all classes some client holds) with their ids to every client
    up_round = sum(held[c] * (4 * d + 16) + 4 * 8 for c in sim.client_ids)
    classes = int(sim.server.present.sum())
    assert summary["bytes_up_total"] == 3 * up_round
    assert summary["bytes_down_total"] == 2 * len(sim.client_ids) * classes * (4 * d + 8)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if ln]
    assert rows[0]["bytes_down"] == 0 and rows[-1]["fedproto/global_classes"] == classes
    assert all("clients/proto_loss" in r and "fedproto/prototype_spread" in r for r in rows)


def test_resume_reaches_the_same_numbers(tmp_path):
    over = {"rounds": 3, "participation": {"join_ratio": 0.5}}
    full = Simulation(tiny_config("fedproto", over), run_dir=tmp_path / "full", tensorboard=False).run()
    Simulation(tiny_config("fedproto", over), run_dir=tmp_path / "part", tensorboard=False).run(stop_after=2)
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == 3
    assert resumed["final"] == full["final"] and resumed["last"] == full["last"]


def test_reference_options_end_to_end(tmp_path):
    s = quick_run("fedproto", tmp_path, sets=("aggregator.weighting=uniform", "aggregator.absent_classes=drop",
                                              "trainer.prototypes_from=last_epoch", "trainer.proto_distance=sum",
                                              "trainer.inference=classifier", "participation.join_ratio=0.5"))
    assert s["rounds_completed"] == 2 and s["client_failures"] == 0 and math.isfinite(s["final"]["uniform"])


def test_fl_run_end_to_end_on_the_feature_shift_dataset(tmp_path):
    res = CliRunner().invoke(cli, [
        "run", "--plugin", "fedproto", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
        "--set", "dataset.name=digits_domains", "--set", "partition.name=by_group", "--set", "partition.num_clients=6",
        "--set", "model.name=mlp", "--set", "model.hidden=[16]", "--set", "rounds=2", "--set", "checkpoint.every=0",
        "--set", "train.batch_size=32"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "fedproto (trainer fedproto, aggregator fedproto)" in res.output and "digits_domains / 6" in res.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["client_failures"] == 0 and summary["final"]["uniform"] > 0.15  # 10 classes: chance 0.1
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if ln]
    assert rows[-1]["fedproto/global_classes"] == 10


def test_regression_data_is_a_clear_cli_error(tmp_path):
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedproto", "--no-progress", "--set", f"output_dir={tmp_path}",
                                   "--set", "dataset.name=pcfl_sine", "--set", "model.name=mlp"])
    assert res.exit_code == 2
    assert "FedProto needs a classification task" in res.output and "Traceback" not in res.output
