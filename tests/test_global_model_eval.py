"""The global model's accuracy beside the personal one (core/engine/globaleval.py, core/api/globalmodel.py): the
core's plain evaluation of the aggregator's global model on every client's test split, on every execution path,
reused where the trainer declares its personal model is the global one, checkpointed, vetted like any evaluation,
and the table metric keys that read it (fl reproduce)."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.core import Algorithm, GlobalModelAggregator, ServerAggregator
from pflkit.core.api import registry as reg
from pflkit.core.api.globalmodel import GLOBAL_EVALUATE
from pflkit.core.api.training import evaluate
from pflkit.core.cli.main import cli
from pflkit.core.engine.backend import SerialBackend
from pflkit.core.engine.simulation import Simulation
from pflkit.core.storage.reporting import format_summary
from pflkit.core.storage.rundata import finished_run_problem, read_records
from pflkit.core.testing import one_process_group, run_with_workers, tiny_config, tiny_run, tiny_simulation

GLOBAL_KEYS = ("global_accuracy/uniform", "global_accuracy/weighted", "global_accuracy/std", "global_reused")


def _records(run_dir):
    return read_records(Path(run_dir) / "metrics.jsonl")


def _global(records):
    """Each evaluated round's global-model numbers (timings left out: they differ between runs)."""
    return [{k: r[k] for k in GLOBAL_KEYS if k in r} for r in records if "accuracy/uniform" in r]


def _plain_scores(sim):
    """The last evaluation's global numbers recomputed here: the final global model scored with the core's
    ``evaluate`` on each client's test split."""
    model = sim.build_model()
    model.load_state_dict(sim.server.global_model())
    per = {cid: evaluate(model, ctx.test, ctx.task) for cid, ctx in sim.contexts.items()}
    n = np.array([r.num_samples for r in per.values()], dtype=np.float64)
    m = np.array([r.metric_sum for r in per.values()], dtype=np.float64)
    return float((m / n).mean()), float(m.sum() / n.sum())


class CountingBackend(SerialBackend):
    """Counts the message kinds it runs."""

    def __init__(self):
        super().__init__()
        self.kinds = {}

    def execute(self, calls, snapshot=False):
        for call in calls.values():
            self.kinds[call.message.kind] = self.kinds.get(call.message.kind, 0) + 1
        return super().execute(calls, snapshot)


@pytest.mark.parametrize("algorithm", ["ditto", "pfedme"])  # ditto: streamed aggregation; pfedme: all replies
def test_global_numbers_are_the_plain_evaluation_of_the_global_model(tmp_path, algorithm):
    sim, summary = tiny_run(algorithm, tmp_path / algorithm, {"rounds": 2})
    records = _records(sim.run_dir)
    uniform, weighted = _plain_scores(sim)
    assert records[-1]["global_accuracy/uniform"] == pytest.approx(uniform, abs=1e-12)
    assert records[-1]["global_accuracy/weighted"] == pytest.approx(weighted, abs=1e-12)
    assert all(r["global_reused"] == 0 and r["global_eval_seconds"] > 0 for r in records)
    assert records[-1]["global_accuracy/uniform"] != records[-1]["accuracy/uniform"]  # a personal model differs
    glob = summary["global"]
    assert glob["source"] == "evaluated" and glob["evaluations"] == 2 and glob["metric"] == "accuracy"
    assert glob["final"]["uniform"] == pytest.approx(np.mean([r["global_accuracy/uniform"] for r in records]))
    best = max(records, key=lambda r: r["global_accuracy/weighted"])
    assert glob["best_weighted"] == {"weighted": best["global_accuracy/weighted"],
                                     "uniform": best["global_accuracy/uniform"], "round": best["round"]}
    assert summary["bytes_down_total"] == tiny_run(algorithm, tmp_path / "again", {"rounds": 2})[1][
        "bytes_down_total"]  # evaluation traffic is not the algorithm's cost (and the run is deterministic)
    assert finished_run_problem(summary, records, 2, sim.cfg.eval.final_k) is None
    edited = json.loads(json.dumps(summary))
    edited["global"]["final"]["uniform"] += 0.125
    assert "global.final.uniform" in finished_run_problem(edited, records, 2, sim.cfg.eval.final_k)


def test_personal_is_global_reuses_the_personal_numbers(tmp_path, registries_snapshot):
    """FedAvg declares personal_is_global: its global numbers are the personal ones, no evaluate_global message is
    sent; without the declaration the core evaluates the same model and gets the same numbers."""
    from pflkit_fedavg import FedAvgTrainer

    backend = CountingBackend()
    sim, summary = tiny_run("fedavg", tmp_path / "reused", backend=backend)
    # the claim is spot-checked at each reuse: the core scores the global model on one client (of 4), 2 evaluations
    assert backend.kinds[GLOBAL_EVALUATE] == 2 and backend.kinds["evaluate"] == 8
    records = _records(sim.run_dir)
    for r in records:
        assert r["global_reused"] == 1 and "global_eval_seconds" not in r
        assert [r[f"global_accuracy/{a}"] for a in ("uniform", "weighted", "std")] == \
            [r[f"accuracy/{a}"] for a in ("uniform", "weighted", "std")]
    assert summary["global"]["source"] == "personal"
    assert summary["global"]["final"] == {k: summary["final"][k] for k in ("k", "uniform", "weighted", "std")}

    class Undeclared(FedAvgTrainer):  # the same trainer, not declaring it (the flag is not inherited)
        pass

    reg.TRAINERS.register("undeclared", Undeclared)
    reg.ALGORITHMS.register("undeclared", Algorithm(trainer="undeclared", aggregator="fedavg"))
    backend = CountingBackend()
    sim2, summary2 = tiny_run("undeclared", tmp_path / "evaluated", backend=backend)
    assert backend.kinds[GLOBAL_EVALUATE] == 8
    assert summary2["global"]["source"] == "evaluated"
    assert _global(_records(sim2.run_dir)) == [{**g, "global_reused": 0} for g in _global(records)]


def test_evaluation_time_adaptation_is_no_global_model(tmp_path):
    """With eval.adapt the personal model is fine-tuned: the global model is evaluated on its own."""
    _, summary = tiny_run("fedavg", tmp_path / "adapt", sets=("eval.adapt=every", "eval.adapt_steps=2"))
    assert summary["global"]["source"] == "evaluated"
    assert summary["global"]["final"]["uniform"] != summary["final"]["uniform"]


def test_no_global_model_and_opt_out(tmp_path, registries_snapshot):
    from pflkit_fedavg import FedAvgAggregator

    _, summary = tiny_run("fedper", tmp_path / "fedper")  # the trainer shares the body only: no whole model
    assert summary["global"] is None
    assert not any(k.startswith("global_") for r in _records(tmp_path / "fedper") for k in r)
    assert "global model none (this algorithm has no global model)" in \
        " ".join(format_summary(summary).split())

    class OptedOut(FedAvgAggregator):
        reports_global_model = False  # e.g. a strategy whose global state is no model to score

    reg.AGGREGATORS.register("opted_out", OptedOut)
    reg.ALGORITHMS.register("opted_out", Algorithm(trainer="ditto", aggregator="opted_out"))
    backend = CountingBackend()
    _, summary = tiny_run("opted_out", tmp_path / "opted", backend=backend)
    assert summary["global"] is None and GLOBAL_EVALUATE not in backend.kinds
    show = CliRunner().invoke(cli, ["show", "opted_out"])
    assert "global model: none -- the aggregator opts out (reports_global_model = False)" in show.output
    show = CliRunner().invoke(cli, ["show", "ditto"])
    assert "global model: reported -- the aggregator's global model is scored on every client's test split" in \
        show.output


def test_any_aggregator_may_name_its_global_model(tmp_path, registries_snapshot):
    """A third-party strategy that is no GlobalModelAggregator names its global model by ``global_model``."""
    from pflkit_local import NoAggregator

    class Anchored(NoAggregator):  # local training, plus a fixed global model: the initial weights
        def global_model(self):
            if not hasattr(self, "anchor"):
                self.anchor = self.ctx.build_model().state_dict()
            return self.anchor

    reg.AGGREGATORS.register("anchored", Anchored)
    reg.ALGORITHMS.register("anchored", Algorithm(trainer="local", aggregator="anchored"))
    sim, summary = tiny_run("anchored", tmp_path / "anchored")
    assert summary["global"]["source"] == "evaluated"
    assert _records(sim.run_dir)[-1]["global_accuracy/uniform"] == pytest.approx(_plain_scores(sim)[0], abs=1e-12)
    g = summary["global"]["final"]  # the untrained model scores the same in both evaluations
    assert [r["global_accuracy/uniform"] for r in _records(sim.run_dir)] == [g["uniform"]] * 2


def test_the_global_evaluation_is_the_cores_own_whatever_the_trainer_answers(tmp_path, registries_snapshot):
    """The core dispatches the global model's evaluation itself (issue 36): a trainer whose handle() answers it with
    an inflated or leaking reply is never asked, so no client fails and every client's global number is the plain
    evaluation of the global model."""
    from pflkit_ditto import DittoTrainer

    class Lying(DittoTrainer):
        def handle(self, message):
            reply = super().handle(message)
            if message.kind == GLOBAL_EVALUATE and self.ctx.cid == 0:
                reply["metric_sum"] = reply["num_samples"] + 5.0  # more correct answers than test samples
            if message.kind == GLOBAL_EVALUATE and self.ctx.cid == 1:
                reply["leak"] = self.ctx.test.x[:2]  # raw samples
            return reply

    reg.TRAINERS.register("lying", Lying)
    reg.ALGORITHMS.register("lying", Algorithm(trainer="lying", aggregator="fedavg"))
    sim, summary = tiny_run("lying", tmp_path / "lying")
    assert not [f for f in sim.failures if f["kind"] == GLOBAL_EVALUATE] and summary["client_failures"] == 0
    model = sim.build_model()
    model.load_state_dict(sim.server.global_model())
    scores = [evaluate(model, sim.contexts[c].test, sim.task).metric for c in (0, 1, 2, 3)]
    assert _records(sim.run_dir)[-1]["global_accuracy/uniform"] == pytest.approx(np.mean(scores), abs=1e-12)


def test_resumed_run_reports_what_the_uninterrupted_run_does(tmp_path):
    over = {"rounds": 3, "checkpoint": {"every": 1}}
    _, whole = tiny_run("ditto", tmp_path / "whole", over)
    part = tiny_simulation("ditto", tmp_path / "part", over)
    assert part.run(stop_after=1)["interrupted"]
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["global"] == whole["global"] and resumed["global"]["evaluations"] == 3
    assert _global(_records(tmp_path / "part")) == _global(_records(tmp_path / "whole"))
    # fl export --summary: the global model's final and best beside the personal ones
    res = CliRunner().invoke(cli, ["export", str(tmp_path / "whole"), "--csv", "-", "--summary"])
    row = next(csv.DictReader(res.output.splitlines()))
    assert float(row["global_final_uniform"]) == whole["global"]["final"]["uniform"]
    assert float(row["global_best_weighted"]) == whole["global"]["best_weighted"]["weighted"]


def test_batched_clients_score_their_global_model(tmp_path):
    """clients.batched=on: the fits run as one stack, the global model's evaluation one client at a time."""
    sim, summary = tiny_run("ditto", tmp_path / "batched", sets=("clients.batched=on",))
    assert summary["clients_batched"]["path"] == "batched" and summary["global"]["source"] == "evaluated"
    uniform, weighted = _plain_scores(sim)
    last = _records(sim.run_dir)[-1]
    assert (last["global_accuracy/uniform"], last["global_accuracy/weighted"]) == pytest.approx((uniform, weighted))


@pytest.mark.parametrize("exact", [True, False])
def test_distributed_backend_in_process_gives_the_serial_numbers(tmp_path, exact):
    from pflkit.core.distributed.backend import DistributedBackend

    over = {"distributed": {"exact": exact}}
    with one_process_group():
        dist = tiny_simulation("ditto", tmp_path / "dist", over, backend=DistributedBackend()).run()
    serial = tiny_run("ditto", tmp_path / "serial", over)[1]
    assert dist["global"] == serial["global"] and dist["global"]["source"] == "evaluated"


def test_two_workers_give_the_serial_numbers(tmp_path):
    """fl run --workers 2: each rank evaluates its own clients' global-model scores; the serial numbers."""
    parallel = run_with_workers(tiny_config("ditto"), 2, tmp_path, "w2", timeout=240)
    _, serial = tiny_run("ditto", tmp_path / "serial")
    assert _global(_records(parallel)) == _global(_records(tmp_path / "serial"))
    assert json.loads((parallel / "summary.json").read_text())["global"] == serial["global"]


GLOBAL_TABLE = """
[paper]
title = "A tiny table scoring the global model"
venue = "pflkit's tests"
table = 1
caption = "embedded digits"

[metric]
model = "global"
clients = "all"
mean = "weighted"
round = "best"
fine_tuned = false
pflkit = "best_global_weighted"

[settings]
rounds = 2
device = "cpu"
dataset = { name = "digits" }
partition = { name = "iid", num_clients = 3 }
model = { name = "mlp", hidden = [16] }
checkpoint = { every = 0 }

[quick]
rounds = 2

[[columns]]
id = "all"
label = "all clients"

[[rows]]
id = "ditto"
label = "Ditto"
plugin = "ditto"
source = "defaults"

[[rows]]
id = "fedper"
label = "FedPer"
plugin = "fedper"
source = "defaults"

[[rows]]
id = "fedper_personal"
label = "FedPer, personal"
plugin = "fedper"
options = { train = { lr = 0.1 } }
source = "defaults, lr 0.1"
metric = { model = "personal", pflkit = "best_weighted", note = "FedPer has no global model" }

[numbers]
ditto = { all = [50.0, 1.0] }
fedper = { all = "no global model" }
fedper_personal = { all = [60.0] }
"""


def test_a_table_scoring_the_global_model(tmp_path):
    """The global keys read summary.json's global section; a method without a global model gets the cell text
    'no global model' (or a row's own personal metric); fl compare's results carry the global finals."""
    path = tmp_path / "global.toml"
    path.write_text(GLOBAL_TABLE)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reproduce", "--table-file", str(path), "--scale", "quick", "--seeds", "0",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    cells = {r["row"]: r for r in csv.DictReader((out / "results.csv").open())}
    summary = json.loads((out / "all" / "runs" / "ditto-seed0" / "summary.json").read_text())
    assert float(cells["ditto"]["pflkit_mean"]) == pytest.approx(
        100 * summary["global"]["best_weighted"]["weighted"], abs=0.006)
    assert cells["fedper"]["pflkit_mean"] == "" and cells["fedper"]["pflkit_note"] == "no global model"
    fedper = json.loads((out / "all" / "runs" / "fedper+train.lr=0.1-seed0" / "summary.json").read_text())
    assert cells["fedper_personal"]["metric"] == "best_weighted" and float(
        cells["fedper_personal"]["pflkit_mean"]) == pytest.approx(100 * fedper["best_weighted"]["weighted"], abs=0.006)
    md = (out / "results.md").read_text()
    assert "n/a (no global model)" in md and "FedPer, personal: personal model, pflkit metric best_weighted" in md
    compared = json.loads((out / "all" / "results.json").read_text())["results"]
    assert compared["ditto"]["final_global_uniform"]["mean"] == pytest.approx(summary["global"]["final"]["uniform"])
    assert "final_global_uniform" not in compared["fedper"]
    assert "Global model (scored on every client's test split)" in (out / "all" / "results.md").read_text()


@pytest.mark.parametrize("edit, words", [
    (('pflkit = "best_global_weighted"', 'pflkit = "best_weighted"'),
     "metric: model = 'global' is not scored by pflkit = 'best_weighted', a personal model's key"),
    (('metric = { model = "personal", pflkit = "best_weighted"', 'metric = { pflkit = "best_weighted"'),
     "rows[2].metric (column all): model = 'global' is not scored by pflkit = 'best_weighted'"),
    ((', note = "FedPer has no global model" }', " }"), "rows[2].metric: 'note' is missing"),
])
def test_table_metric_and_model_must_agree(tmp_path, edit, words):
    path = tmp_path / "bad.toml"
    assert edit[0] in GLOBAL_TABLE
    path.write_text(GLOBAL_TABLE.replace(edit[0], edit[1], 1))
    result = CliRunner().invoke(cli, ["reproduce", "--check", "--table-file", str(path)])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and words in lines[0], result.output


def test_a_false_personal_is_global_claim_is_caught_and_the_global_model_scored(tmp_path, registries_snapshot, caplog):
    """A trainer that declares personal_is_global but scores another model (here: its received model with the head
    zeroed) reported 100 % global accuracy for a model at 36.81 % (issue 36): the claim is spot-checked against the
    core's own evaluation, found false, said once, and the global model is scored separately from then on."""
    import logging

    import torch
    from pflkit_fedavg import FedAvgTrainer

    class Claims(FedAvgTrainer):
        personal_is_global = True

        def personal_forward(self):
            model = self.model

            def forward(x):
                return model(x) * 0 + torch.arange(model(x).shape[1], dtype=torch.float32)  # always the last class
            return forward

    reg.TRAINERS.register("claims", Claims)
    reg.ALGORITHMS.register("claims", Algorithm(trainer="claims", aggregator="fedavg"))
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        sim, summary = tiny_run("claims", tmp_path / "claims")
    warnings = [r for r in caplog.records if "declares personal_is_global" in r.getMessage()]
    assert len(warnings) == 1 and "Claims" in warnings[0].getMessage()
    records = _records(sim.run_dir)
    assert all(r["global_reused"] == 0 for r in records) and summary["global"]["source"] == "evaluated"
    model = sim.build_model()
    model.load_state_dict(sim.server.global_model())
    scores = [evaluate(model, sim.contexts[c].test, sim.task).metric for c in sim.client_ids]
    assert records[-1]["global_accuracy/uniform"] == pytest.approx(np.mean(scores), abs=1e-12)
    assert records[-1]["global_accuracy/uniform"] != records[-1]["accuracy/uniform"]
