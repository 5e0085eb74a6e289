"""split.val: a seeded, stratified validation split of each client's training rows, scored beside the test split, and
the test metric at the evaluation chosen on it (``selected*``) beside the best-on-test one."""
import hashlib
import json

import numpy as np
import pytest
import torch

from pflkit.core.api.client import ClientContext, ClientTrainer
from pflkit.core.api.task import classification
from pflkit.core.api.training import TensorData, evaluate
from pflkit.core.common.errors import ConfigError
from pflkit.core.data.data import ClientSplit, FederatedData, build_federated_data, with_validation
from pflkit.core.engine.evaluation import History, summarize
from pflkit.core.engine.replies import ReplyChecks
from pflkit.core.results.compare import run_comparison
from pflkit.core.storage.rundata import finished_run_problem, load_run, read_records, summary_table
from pflkit.core.testing import (TINY, assert_one_line_error, assert_resume_matches_full_run,
                                 assert_workers_match_serial, tiny_config, tiny_simulation)


def _splits(val: float, seed: int = 0):
    return build_federated_data(tiny_config("fedavg", {"split": {"val": val}, "seed": seed})).splits


def test_without_validation_the_partition_and_its_fingerprint_are_those_of_earlier_versions():
    fed = build_federated_data(tiny_config("fedavg"))
    assert not fed.has_validation and all(len(s.val) == 0 for s in fed.splits)
    digest = hashlib.sha256()  # the digest of train and test only, as before split.val existed
    for s in fed.splits:
        for part in (s.train, s.test):
            arr = np.ascontiguousarray(part, dtype="<i8")
            digest.update(len(arr).to_bytes(8, "little"))
            digest.update(arr.tobytes())
    assert fed.fingerprint() == digest.hexdigest()
    assert "val" not in fed.summary()["clients"][0]


def test_validation_rows_come_out_of_the_training_rows_stratified_and_seeded():
    plain, held = _splits(0.0), _splits(0.2)
    labels = build_federated_data(tiny_config("fedavg")).bundle.labels_for_partition()
    for a, b in zip(plain, held):
        assert np.array_equal(a.test, b.test)  # the test split is untouched
        assert np.array_equal(np.sort(np.r_[b.train, b.val]), a.train)
        assert not np.intersect1d(b.train, b.val).size
        assert len(b.val) == round(0.2 * len(a.train))
        # stratified: each label's share of the validation rows is its share of the training rows, to one row
        counts_train = np.bincount(labels[a.train], minlength=10)
        counts_val = np.bincount(labels[b.val], minlength=10)
        assert np.all(np.abs(counts_val - counts_train * len(b.val) / len(a.train)) <= 1)
    again = _splits(0.2)
    assert all(np.array_equal(x.val, y.val) for x, y in zip(held, again))
    other = _splits(0.2, seed=1)
    assert any(not np.array_equal(x.val, y.val) for x, y in zip(held, other))


def test_a_client_too_small_for_a_validation_row_is_one_clear_line(tmp_path):
    tiny = ClientSplit(np.array([0, 1]), np.array([3]))
    cfg = tiny_config("fedavg", {"split": {"val": 0.1}})
    with pytest.raises(ConfigError, match=r"split.val: client 0 has 2 training samples, too few"):
        with_validation(cfg, [tiny], np.zeros(4, dtype=np.int64))
    assert_one_line_error(["run", "--plugin", "fedavg", "--set", "partition.num_clients=4", "--set",
                           "model.name=mlp", "--set", "split.val=0.999", "--set", f"output_dir={tmp_path}"],
                          "split.val: client", tmp_path, strict=True)
    assert_one_line_error(["run", "--plugin", "fedavg", "--set", "split.val=1", "--set", f"output_dir={tmp_path}"],
                          "split.val", tmp_path, strict=True)


def _context(val: TensorData) -> ClientContext:
    g = torch.Generator().manual_seed(0)
    test = TensorData(torch.randn(7, 3, generator=g), torch.randint(0, 2, (7,), generator=g))
    from easydict import EasyDict

    return ClientContext(cid=0, train=test, test=test, task=classification(2), device=torch.device("cpu"),
                         hp=EasyDict(), train_cfg=EasyDict(eval_batch_size=4), build_model=lambda: None,
                         num_clients=1, seed=0, val=val)


def test_evaluate_model_scores_the_validation_split_with_the_same_model():
    g = torch.Generator().manual_seed(1)
    val = TensorData(torch.randn(5, 3, generator=g), torch.randint(0, 2, (5,), generator=g))
    ctx = _context(val)
    model = torch.nn.Linear(3, 2)
    reply = ClientTrainer(ctx).evaluate_model(model)
    alone = evaluate(model, val, ctx.task, 4)
    assert reply["val_loss_sum"] == alone.loss_sum and reply["val_metric_sum"] == alone.metric_sum
    assert {k: reply[k] for k in ("loss_sum", "metric_sum")} == {
        k: v for k, v in evaluate(model, ctx.test, ctx.task, 4).as_dict().items() if k != "num_samples"}
    assert "val_loss_sum" not in ClientTrainer(_context(None)).evaluate_model(model)


def test_a_reply_without_or_with_impossible_validation_sums_is_refused():
    checks = ReplyChecks({0: 10, 1: 10}, {0: 4, 1: 4}, True, val_sizes={0: 3, 1: 0})
    plain = {"loss_sum": 1.0, "metric_sum": 2.0}
    assert "lacks 'val_loss_sum'" in checks.evaluation_problem(0, plain)
    assert "split.val" in checks.evaluation_problem(0, plain)
    assert checks.evaluation_problem(1, plain) is None  # a client without a validation split
    assert "exceeds its 3 validation samples" in checks.evaluation_problem(
        0, {**plain, "val_loss_sum": 1.0, "val_metric_sum": 4.0})
    assert "not a finite number" in checks.evaluation_problem(
        0, {**plain, "val_loss_sum": float("nan"), "val_metric_sum": 1.0})
    assert checks.evaluation_problem(0, {**plain, "val_loss_sum": 1.0, "val_metric_sum": 3.0}) is None


def test_validation_means_are_uniform_and_pooled():
    results = {0: {"num_samples": 4, "loss_sum": 4.0, "metric_sum": 2.0, "val_num_samples": 2,
                   "val_loss_sum": 1.0, "val_metric_sum": 2.0},
               1: {"num_samples": 4, "loss_sum": 4.0, "metric_sum": 4.0, "val_num_samples": 6,
                   "val_loss_sum": 3.0, "val_metric_sum": 3.0}}
    s = summarize(results)
    assert s["val_accuracy/uniform"] == pytest.approx((1.0 + 0.5) / 2)
    assert s["val_accuracy/weighted"] == pytest.approx(5 / 8)
    assert s["val_loss/weighted"] == pytest.approx(4 / 8)
    assert not any(k.startswith("val_") for k in summarize({0: results[0] | {"val_num_samples": 0}}))


def test_selection_reads_validation_only_and_each_client_keeps_its_own_round():
    h = History("accuracy", True)
    for rnd, (test, val) in enumerate([(0.5, 0.6), (0.9, 0.5), (0.7, 0.8), (0.6, 0.8)], start=1):
        h.add(rnd, {"accuracy/uniform": test, "accuracy/weighted": test, "val_accuracy/uniform": val,
                    "val_accuracy/weighted": val})
    assert h.best()["round"] == 2  # on test
    assert h.selected("uniform") == {"uniform": 0.7, "val_uniform": 0.8, "round": 3}  # the first of equal ones
    h.note_clients(1, {0: 0.5, 1: 0.9}, {0: 0.9, 1: 0.1})
    h.note_clients(2, {0: 0.99, 1: 0.2}, {0: 0.2, 1: 0.3})
    assert h.client_selection == {"0": [0.9, 0.5, 1], "1": [0.3, 0.2, 2]}
    assert h.selected_per_client() == {"uniform": pytest.approx(0.35), "clients": 2}
    restored = History("accuracy", True)
    restored.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert restored.summary(1) == h.summary(1)
    assert "selected" not in History("accuracy", True).summary(1)


def test_a_run_records_validation_metrics_and_selects_on_them(tmp_path):
    sim = tiny_simulation("fedper", tmp_path / "run", {"rounds": 4, "split": {"val": 0.2}})
    result = sim.run()
    records = [json.loads(line) for line in (sim.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "val_accuracy/uniform" in r]
    assert len(evaluated) == 4
    i = int(np.argmax([r["val_accuracy/uniform"] for r in evaluated]))
    assert result["selected"]["round"] == evaluated[i]["round"]
    assert result["selected"]["uniform"] == evaluated[i]["accuracy/uniform"]
    assert result["selected_per_client"]["clients"] == 4
    saved = json.loads((sim.run_dir / "partition.json").read_text())
    assert all(len(c["val_indices"]) == c["val"] > 0 for c in saved["clients"])
    row = summary_table([load_run(sim.run_dir)])[0]
    assert row["selected_uniform"] == result["selected"]["uniform"] and row["selected_round"] == i + 1

    # the saved partition, validation included, is what partition.from reuses
    again = tiny_simulation("fedper", tmp_path / "again", {"rounds": 1, "partition": {"from": str(sim.run_dir)}})
    assert [list(s.val) for s in again.data.splits] == [c["val_indices"] for c in saved["clients"]]
    again.abandon()


def test_fl_compare_reports_the_validation_selected_numbers(tmp_path):
    layer = {**TINY, "split": {"val": 0.2}}
    results = run_comparison(["fedavg", "local"], [0], [layer], tmp_path)
    table = (tmp_path / "results.md").read_text()
    assert "selected accuracy, uniform (%)" in table and "selected accuracy, per client (%)" in table
    for algo in ("fedavg", "local"):
        summary = json.loads((tmp_path / "runs" / f"{algo}-seed0" / "summary.json").read_text())
        assert results["results"][algo]["selected_uniform"]["mean"] == summary["selected"]["uniform"]


def test_a_resumed_run_selects_as_the_run_made_in_one_go(tmp_path):
    assert_resume_matches_full_run("fedper", {"rounds": 4, "split": {"val": 0.2}, "checkpoint": {"every": 1}},
                                   tmp_path, stop_after=2)
    full, part = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("full", "part"))
    for key in ("selected", "selected_weighted", "selected_per_client"):
        assert part[key] == full[key]


def test_the_selected_numbers_are_checked_against_the_logged_evaluations(tmp_path):
    sim = tiny_simulation("fedper", tmp_path / "run", {"rounds": 3, "split": {"val": 0.2}})
    summary = sim.run()
    records = read_records(sim.run_dir / "metrics.jsonl")
    assert all(set(r["per_client_val"]) == set(r["per_client"]) for r in records if r["round"] >= 1)
    summary = json.loads(json.dumps(summary))
    assert finished_run_problem(summary, records, 3, 5) is None
    for key, part in (("selected", "uniform"), ("selected", "round"), ("selected_weighted", "weighted"),
                      ("selected_per_client", "uniform")):
        edited = json.loads(json.dumps(summary))
        edited[key][part] = (edited[key][part] or 0) + (1 if part == "round" else 0.01)
        assert f"summary.json gives {key}.{part}" in finished_run_problem(edited, records, 3, 5)


def test_two_workers_give_the_serial_validation_numbers(tmp_path):
    assert_workers_match_serial("fedper", {"split": {"val": 0.2}}, tmp_path)


@pytest.mark.parametrize("algorithm", ["ditto", "fedavg"])  # the global model scored apart; its numbers reused
def test_the_global_model_is_selected_on_its_own_validation_means(tmp_path, algorithm):
    sim = tiny_simulation(algorithm, tmp_path / "run", {"rounds": 3, "split": {"val": 0.2}})
    summary = json.loads(json.dumps(sim.run()))
    records = [r for r in read_records(sim.run_dir / "metrics.jsonl") if "val_global_accuracy/uniform" in r]
    assert len(records) == 3
    best = max(records, key=lambda r: r["val_global_accuracy/uniform"])  # the first of equal ones
    assert summary["global"]["selected"] == {"uniform": best["global_accuracy/uniform"],
                                             "val_uniform": best["val_global_accuracy/uniform"],
                                             "round": best["round"]}
    summary["global"]["selected"]["uniform"] += 0.01
    assert "summary.json gives global.selected.uniform" in finished_run_problem(
        summary, read_records(sim.run_dir / "metrics.jsonl"), 3, 5)
