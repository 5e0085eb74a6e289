"""Evaluation-time adaptation (core/api/adaptation.py): a scratch copy is adapted and scored; the client's kept state,
the training randomness and everything the run trains stay exactly as without it; the cost is reported."""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from easydict import EasyDict
from torch import nn

from pflkit.core import Simulation
from pflkit.core.api.adaptation import AdaptationSettings, evaluation_rounds, settings_from_config
from pflkit.core.engine.backend import SerialBackend
from pflkit.core.cli.main import cli
from pflkit.core.api.client import ClientContext
from pflkit.core.api.clientstate import same_state
from pflkit.core.common.errors import ConfigError
from pflkit.core.api.task import classification
from pflkit.core.testing import run_capturing_replies, tiny_config
from pflkit.core.api.training import TensorData
from pflkit_fedavg import FedAvgTrainer
from pflkit_fedper import FedPerTrainer


class LegacyBackend(SerialBackend):
    """One live trainer per client, whatever the trainer declares (the legacy path)."""

    def start(self, build_trainer, client_ids, state_options=None):
        super().start(lambda cid: build_trainer(cid), client_ids)


def records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines]


def simulate(tmp_path, name, algorithm="fedavg", sets=(), backend=None):
    cfg = tiny_config(algorithm, {"rounds": 3, "participation": {"join_ratio": 0.5}}, sets)
    return Simulation(cfg, run_dir=tmp_path / name, tensorboard=False, backend=backend)


# -- one client ----------------------------------------------------------------------------------------------
def small_model():
    torch.manual_seed(0)
    from pflkit.models.base import SplitModel
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 3), 8)


def client(trainer_cls, adaptation, seed=7):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    ctx = ClientContext(cid=0, train=TensorData(x[:30], y[:30]), test=TensorData(x[30:], y[30:]),
                        task=classification(3), device=torch.device("cpu"), hp=EasyDict(),
                        train_cfg=EasyDict(optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=1e-3,
                                           batch_size=8, local_epochs=1, eval_batch_size=64),
                        build_model=small_model, num_clients=1, seed=0, adaptation=adaptation)
    ctx.generator.manual_seed(seed)
    return trainer_cls(ctx)


@pytest.mark.parametrize("trainer_cls", [FedAvgTrainer, FedPerTrainer])
def test_evaluation_leaves_the_kept_state_bit_for_bit_and_scores_the_adapted_copy(trainer_cls):
    plain = client(trainer_cls, None).on_evaluate({})
    adapt = AdaptationSettings("every", steps=3, epochs=None, lr=None, params="all")
    c = client(trainer_cls, adapt)
    before = {k: v.clone() for k, v in c.model.state_dict().items()}
    declared = c.client_state()
    flags = [p.requires_grad for p in c.model.parameters()]
    reply = c.on_evaluate({})
    assert same_state(c.model.state_dict(), before) and same_state(c.client_state(), declared)
    assert [p.requires_grad for p in c.model.parameters()] == flags
    assert reply["adapt_steps"] == 3 and reply["adapt_seconds"] >= 0
    assert reply["loss_sum"] != plain["loss_sum"]  # the adapted copy was scored, not the kept model
    again = client(trainer_cls, adapt).on_evaluate({})  # same call seed: the same adapted score
    assert (again["loss_sum"], again["metric_sum"]) == (reply["loss_sum"], reply["metric_sum"])
    other = client(trainer_cls, adapt, seed=8).on_evaluate({})  # its batches come from the call's generator
    assert other["loss_sum"] != reply["loss_sum"]


def test_parameter_subsets_steps_and_epochs():
    c = client(FedAvgTrainer, None)
    head = [p.detach().clone() for p in c.model.head.parameters()]
    body = [p.detach().clone() for p in c.model.features.parameters()]
    scratch = {}
    orig_eval = c.evaluate_model

    def keep(model, modules=()):
        scratch["m"] = model
        return orig_eval(model, modules)

    c.evaluate_model = keep
    c.ctx.adaptation = AdaptationSettings("every", steps=None, epochs=2, lr=0.1, params="head")
    reply = c.on_evaluate({})
    assert reply["adapt_steps"] == 2 * 4  # 30 samples, batch 8: 4 steps an epoch
    m = scratch["m"]
    assert all(torch.equal(a, b) for a, b in zip(body, m.features.parameters()))  # weight decay never moved them
    assert not all(torch.equal(a, b) for a, b in zip(head, m.head.parameters()))
    c.ctx.adaptation = AdaptationSettings("every", steps=6, epochs=None, lr=0.1, params="body")
    c.on_evaluate({})
    m = scratch["m"]
    assert all(torch.equal(a, b) for a, b in zip(head, m.head.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(body, m.features.parameters()))


def test_settings_from_config_and_final_rounds():
    assert evaluation_rounds(10, 3) == [3, 6, 9, 10]
    cfg = tiny_config("fedavg", sets=("rounds=10", "eval.every=3", "eval.final_k=2", "eval.adapt=final"))
    s = settings_from_config(cfg)
    assert s.rounds == {9, 10} and s.epochs == 1 and s.steps is None and not s.applies(6) and s.applies(10)
    assert settings_from_config(tiny_config("fedavg")) is None
    s = settings_from_config(tiny_config("fedavg", sets=("eval.adapt=every", "eval.adapt_steps=4")))
    assert s.rounds is None and s.steps == 4 and s.epochs is None and s.applies(1)


# -- whole runs ----------------------------------------------------------------------------------------------
def test_adapting_evaluation_changes_no_training_number_and_reports_its_cost(tmp_path):
    base = simulate(tmp_path, "base")
    base_up = run_capturing_replies(base)
    sim = simulate(tmp_path, "adapt", sets=("eval.adapt=every", "eval.adapt_steps=2"))
    up = run_capturing_replies(sim)
    for rnd in base_up:  # every upload of every round, bit for bit
        assert sorted(up[rnd]) == sorted(base_up[rnd])
        for cid in base_up[rnd]:
            assert same_state(up[rnd][cid]["params"], base_up[rnd][cid]["params"])
            assert up[rnd][cid]["train_loss"] == base_up[rnd][cid]["train_loss"]
    a, b = records(tmp_path / "adapt"), records(tmp_path / "base")
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == rb["train_loss"] and ra["bytes_up"] == rb["bytes_up"]
        assert ra["accuracy/uniform"] != rb["accuracy/uniform"]
        assert ra["adapt/clients"] == 4 and ra["adapt/steps"] == 4 * 2 and "adapt/steps" not in rb
    raw = json.loads((tmp_path / "adapt" / "metrics.jsonl").read_text().splitlines()[0])
    assert raw["adapt/seconds"] > 0
    again = simulate(tmp_path, "again", sets=("eval.adapt=every", "eval.adapt_steps=2"))
    again.run()
    assert records(tmp_path / "again") == a  # reproducible


def test_final_adapts_only_the_evaluations_the_final_metric_averages(tmp_path):
    sim = simulate(tmp_path, "final", sets=("eval.adapt=final", "eval.final_k=2"))
    summary = sim.run()
    recs = records(tmp_path / "final")
    assert ["adapt/steps" in r for r in recs] == [False, True, True]
    assert summary["final"]["uniform"] == pytest.approx(sum(r["accuracy/uniform"] for r in recs[1:]) / 2)


def test_pooled_equals_legacy_and_evaluation_stores_nothing(tmp_path):
    sets = ("eval.adapt=every", "eval.adapt_epochs=1", "eval.adapt_params=all")
    pooled = simulate(tmp_path, "pooled", "fedper", sets)
    assert pooled.backend.pool is not None
    puts, evaluating = [], [False]
    store = pooled.backend.pool.store
    put, evaluate_all = store.put, pooled.evaluate_all

    def spy_put(cid, state):
        puts.append((evaluating[0], cid))
        return put(cid, state)

    def spy_eval(rnd):
        evaluating[0] = True
        try:
            return evaluate_all(rnd)
        finally:
            evaluating[0] = False

    store.put, pooled.evaluate_all = spy_put, spy_eval
    pooled.run()
    assert puts and not any(during for during, _ in puts)  # training stored states; evaluation none
    legacy = simulate(tmp_path, "legacy", "fedper", sets, backend=LegacyBackend())
    legacy.run()
    assert legacy.backend.pool is None
    assert records(tmp_path / "pooled") == records(tmp_path / "legacy")


# -- bad input -----------------------------------------------------------------------------------------------
def _no_head(input_shape, num_classes, **_):
    size = 1
    for d in input_shape:
        size *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(size, num_classes))


@pytest.mark.parametrize("sets, message", [
    (("eval.adapt=sometimes",), "eval.adapt: 'sometimes' is not one of"),
    (("eval.adapt=every", "eval.adapt_steps=0"), "eval.adapt_steps: 0 is invalid: must be > 0"),
    (("eval.adapt=every", "eval.adapt_lr=-1"), "eval.adapt_lr: -1.0 is invalid"),
    (("eval.adapt=every", "eval.adapt_steps=2", "eval.adapt_epochs=1"), "give one of them"),
    (("eval.adapt=every", "eval.adapt_params=tail"), "eval.adapt_params: 'tail' is not a parameter set"),
    (("eval.adapt=every", "--plugin", "fedrod"), "does not support evaluation-time adaptation"),
    (("eval.adapt=every", "eval.adapt_params=head", "model.name=adapt_test_nohead"), "has no 'head' sub-module"),
])
def test_bad_values_are_one_line_and_exit_2(tmp_path, sets, message, registries_snapshot):
    registries_snapshot.MODELS.register("adapt_test_nohead", _no_head)
    args = ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "rounds=1",
            "--set", "partition.num_clients=2", "--set", "model.name=mlp"]
    rest = list(sets)
    if "--plugin" in rest:
        i = rest.index("--plugin")
        args[2] = rest[i + 1]
        del rest[i:i + 2]
    for s in rest:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.output, res.output
    assert not any(tmp_path.iterdir())  # nothing half-made left behind


def test_a_trainer_overriding_on_evaluate_can_declare_it_adapts():
    from pflkit.core.api.adaptation import check_trainer

    class Scores(FedAvgTrainer):
        def on_evaluate(self, payload):
            return super().on_evaluate(payload)

    adapt = AdaptationSettings("every", 1, None, None, "all")
    with pytest.raises(ConfigError, match="does not support"):
        check_trainer(Scores, adapt)
    Scores.adapts_at_evaluation = True
    check_trainer(Scores, adapt)
