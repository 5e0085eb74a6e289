"""fl tune: search ranges declared with the options, an Optuna study in SQLite that continues, reproduces and refuses
what it must, trials scored on validation only, best.toml / trials.csv / plots."""
import csv
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.core.api.space import Space, parse_space, space_problem
from pflkit.core.cli.main import cli
from pflkit.core.common.errors import ConfigError
from pflkit.core.engine.config import declared_params, load_file, resolve
from pflkit.core.results.tuning import search_spaces
from pflkit.core.testing import assert_one_line_error

pytest.importorskip("optuna")

TINY = ["--set", "rounds=3", "--set", "partition.num_clients=4", "--set", "model.name=mlp", "--set",
        "model.hidden=[32]", "--set", "checkpoint.every=1"]
SPACE = ["--space", "trainer.mu=log:0.001..1", "--space", "train.local_epochs=off"]


def _tune(out: Path, trials: int, *extra: str):
    res = CliRunner().invoke(cli, ["tune", "-p", "fedprox", "--trials", str(trials), "--out", str(out), *TINY, *SPACE,
                                   *extra])
    assert res.exit_code == 0, res.output
    return res.output


def _rows(out: Path):
    with open(out / "trials.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_range_texts_parse_and_bad_ones_are_one_clear_line():
    assert parse_space("k", "log:0.001..0.5") == Space.real(0.001, 0.5, log=True)
    assert parse_space("k", "int:1..5") == Space.integer(1, 5)
    assert parse_space("k", "choice:0.01,0.1,sgd").choices == (0.01, 0.1, "sgd")
    assert parse_space("k", "off") is None
    assert Space.real(0.001, 0.5, log=True).text() == "log:0.001..0.5"
    for text, why in [("log:0..1", "LOW > 0"), ("float:1..1", "empty"), ("int:1.5..3", "integer bounds"),
                      ("gauss:0..1", "expected one of"), ("float:0.1", "LOW..HIGH"), ("choice:", "empty choice"),
                      ("choice:1,1", "twice"), ("float:a..b", "finite numbers")]:
        with pytest.raises(ConfigError, match=why):
            parse_space("train.lr", text)


def test_declared_ranges_are_checked_against_their_options():
    cfg = resolve([], algorithm="fedprox")
    params = declared_params(cfg)
    assert params["train.lr"].space is not None and params["trainer.mu"] is not None
    assert "must be > 0" in space_problem("train.lr", Space.real(-1.0, 1.0), params["train.lr"])
    assert "not a number" in space_problem("train.optimizer", Space.real(0.0, 1.0), params["train.optimizer"])
    assert space_problem("train.optimizer", Space.choice(["sgd", "adam"]), params["train.optimizer"]) is None
    assert "takes integers" in space_problem("train.local_epochs", Space.real(1.0, 2.0), params["train.local_epochs"])
    spaces = search_spaces(cfg, {"trainer.mu": "log:0.001..1", "train.local_epochs": "off"})
    assert list(spaces) == ["train.lr", "trainer.mu"]
    with pytest.raises(ConfigError, match="unknown option"):
        search_spaces(cfg, {"trainer.muu": "float:0..1"})
    with pytest.raises(ConfigError, match="nothing to tune"):  # FedAvg declares no range of its own
        search_spaces(resolve([], algorithm="fedavg"), {"train.lr": "off", "train.local_epochs": "off"})
    assert list(search_spaces(cfg, {})) == ["train.local_epochs", "train.lr", "trainer.mu"]
    assert cfg and params["trainer.mu"].space.choices == (0.001, 0.01, 0.1, 1.0)  # the paper's grid


def test_fl_show_prints_the_ranges():
    res = CliRunner().invoke(cli, ["show", "core"])
    assert res.exit_code == 0 and "fl tune searches log:0.001..0.5" in res.output


def test_a_study_writes_its_files_continues_and_reproduces(tmp_path):
    out = _tune(tmp_path / "a", 3)
    assert "split.val = 0.15" in out and "[3/3]" in out
    rows = _rows(tmp_path / "a")
    assert [r["state"] for r in rows] == ["complete"] * 3
    for name in ("best.toml", "trials.csv", "history.png", "importance.png", "study.db"):
        assert (tmp_path / "a" / name).is_file()
    best = max(rows, key=lambda r: float(r["val_accuracy/uniform"]))
    cfg = resolve([load_file(tmp_path / "a" / "best.toml")])
    assert cfg.algorithm == "fedprox" and cfg.rounds == 3 and cfg.split.val == 0.15
    assert cfg.trainer.mu == float(best["trainer.mu"]) and cfg.train.lr == float(best["train.lr"])
    # the value is the best validation evaluation of the trial's own run, never a test number
    records = [r for r in (Path(best["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    import json

    vals = [json.loads(r).get("val_accuracy/uniform") for r in records]
    assert float(best["val_accuracy/uniform"]) == max(v for v in vals if v is not None)

    again = _tune(tmp_path / "a", 3)  # the same command: nothing to add
    assert "3 of 3 trials done" in again and "[" not in again.split("\n", 2)[-1].split("best:")[0]
    assert _rows(tmp_path / "a") == rows
    _tune(tmp_path / "a", 4)
    assert len(_rows(tmp_path / "a")) == 4

    _tune(tmp_path / "b", 4)  # the same command elsewhere: the same trials
    key = lambda rs: [(r["state"], r["val_accuracy/uniform"], r["train.lr"], r["trainer.mu"]) for r in rs]  # noqa
    assert key(_rows(tmp_path / "b")) == key(_rows(tmp_path / "a"))


def test_parallel_batches_reproduce(tmp_path):
    _tune(tmp_path / "a", 4, "--jobs", "2")
    _tune(tmp_path / "b", 4, "--jobs", "2")
    key = lambda rs: [(r["state"], r["val_accuracy/uniform"], r["train.lr"], r["trainer.mu"]) for r in rs]  # noqa
    assert key(_rows(tmp_path / "a")) == key(_rows(tmp_path / "b"))
    assert len(_rows(tmp_path / "a")) == 4


def test_a_diverging_trial_fails_and_is_never_the_best(tmp_path):
    out = _tune(tmp_path / "bad", 2, "--space", "train.lr=choice:1e30")
    assert [r["state"] for r in _rows(tmp_path / "bad")] == ["fail", "fail"]
    assert "no trial completed yet" in out and not (tmp_path / "bad" / "best.toml").exists()
    out = _tune(tmp_path / "mixed", 3, "--space", "train.lr=choice:1e30,0.05")
    rows = _rows(tmp_path / "mixed")
    assert {r["train.lr"] for r in rows} == {"1e+30", "0.05"}, rows
    for r in rows:
        assert (r["state"] == "fail") == (r["train.lr"] == "1e+30"), rows
    assert "train.lr=0.05" in out.split("best:")[1]


def _lines(tmp_path, *args):
    return ["tune", "-p", "fedprox", "--out", str(tmp_path / "study"), *TINY, *args]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, fragment in [(["--trials", "0"], "--trials 0"),
                           (["--trials", "2", "--space", "trainer.muu=float:0..1"], "unknown option"),
                           (["--trials", "2", "--space", "trainer.mu=float:1..0"], "is empty"),
                           (["--trials", "2", "--space", "train.optimizer=float:0..1"], "not a number"),
                           (["--trials", "2", "--space", "train.lr=float:-1..1"], "refuses"),
                           (["--trials", "2", "--metric", "accuracy/uniform"], "never the test")]:
        assert_one_line_error(_lines(tmp_path, *args), fragment, tmp_path)

    study = tmp_path / "study"
    study.mkdir()
    (study / "study.db").write_bytes(b"not a database at all" * 100)
    assert_one_line_error(_lines(tmp_path, "--trials", "1"), "damaged", tmp_path / "study")
    (study / "study.db").unlink()
    with sqlite3.connect(study / "study.db") as db:
        db.execute("CREATE TABLE notes (x)")
    assert_one_line_error(_lines(tmp_path, "--trials", "1"), "not an Optuna study", tmp_path / "study")
    assert sqlite3.connect(study / "study.db").execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]


def test_another_configuration_or_a_second_tuner_on_one_study_is_refused(tmp_path):
    _tune(tmp_path / "s", 1)
    res = CliRunner().invoke(cli, ["tune", "-p", "fedprox", "--trials", "2", "--out", str(tmp_path / "s"), *TINY,
                                   *SPACE, "--set", "train.batch_size=16"])
    assert res.exit_code == 2 and "holds a study of another configuration" in res.output
    fd = os.open(tmp_path / "s" / "tune.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        res = CliRunner().invoke(cli, ["tune", "-p", "fedprox", "--trials", "2", "--out", str(tmp_path / "s"),
                                       *TINY, *SPACE])
        assert res.exit_code == 2 and "another fl tune is running" in res.output
    finally:
        os.close(fd)
    assert len(_rows(tmp_path / "s")) == 1


def test_a_killed_tuner_loses_only_the_trial_in_flight(tmp_path):
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "pflkit.core.cli", "tune", "-p", "fedprox", "--trials", "2", "--out", str(out),
           "--set", "rounds=40", *TINY[2:], *SPACE, "--space", "train.lr=choice:0.05"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("trials/trial-0000/checkpoint*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "1 trial(s) interrupted earlier" in res.stdout
    rows = _rows(out)
    assert [r["state"] for r in rows] == ["interrupted", "complete", "complete"], rows
    assert rows[1]["run_dir"] == rows[0]["run_dir"] and rows[1]["trainer.mu"] == rows[0]["trainer.mu"]
    info = (Path(rows[1]["run_dir"]) / "run_info.json").read_text()
    assert '"resume"' in info or '"restart"' in info  # the interrupted run went on from its checkpoint


def test_compare_tune_compares_every_row_at_its_given_and_its_tuned_options(tmp_path):
    import json

    from pflkit.core.results.compare import run_comparison
    from pflkit.core.testing import TINY as TINY_LAYER

    layer = {**TINY_LAYER, "rounds": 3}
    results = run_comparison(["fedavg", "local"], [0], [layer], tmp_path, tune_trials=2)
    assert results["algorithms"] == ["fedavg", "fedavg tuned", "local", "local tuned"]
    record = json.loads((tmp_path / "tuned.json").read_text())
    for label in ("fedavg", "local"):
        best = record["rows"][label]["best"]
        cfg = json.loads((tmp_path / "runs" / f"{label}_tuned-seed0" / "config.json").read_text())
        assert cfg["train"]["lr"] == best["train.lr"] and cfg["split"]["val"] == 0.15
        assert _rows(tmp_path / "tune" / label)[0]["state"] in ("complete", "pruned", "fail")
    tau = results["tuning"]["kendall_tau"]
    assert tau["rows"] == ["fedavg", "local"] and -1 <= tau["tau"] <= 1
    assert "Kendall's tau" in (tmp_path / "results.md").read_text()
    lines = []
    run_comparison(["fedavg", "local"], [0], [layer], tmp_path, tune_trials=2, echo=lines.append)
    assert sum("reused" in line for line in lines) == 4 and "2 of 2 trials done" in "\n".join(lines)
    assert len(_rows(tmp_path / "tune" / "fedavg")) == 2
    (tmp_path / "empty").mkdir()
    assert_one_line_error(["compare", "--plugins", "fedavg", "--out", str(tmp_path / "empty" / "x"), "--tune", "0"],
                          "--tune 0", tmp_path / "empty")


def test_reproduce_tune_reports_the_tuned_rows_beside_the_paper(tmp_path):
    import json

    from test_reproduce import TINY_TABLE

    (tmp_path / "tiny.toml").write_text(TINY_TABLE)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["reproduce", "--table-file", str(tmp_path / "tiny.toml"), "--scale", "quick",
                                   "--cols", "mean,pooled,third", "--seeds", "0", "--tune", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "pflkit tuned (selected round)" in res.output and "Kendall's tau between pflkit's orders" in res.output
    rows = {(r["row"], r["column"]): r for r in csv.DictReader((out / "results.csv").open())}
    comparison = json.loads((out / "mean-tune" / "results.json").read_text())["results"]
    for row in ("fedavg", "fedprox"):
        label = "fedavg" if row == "fedavg" else "fedprox+trainer.mu=0.1"
        tuned = comparison[f"{label} tuned"]
        assert float(rows[row, "mean"]["tuned_mean"]) == pytest.approx(100 * tuned["selected_uniform"]["mean"],
                                                                       abs=0.006)
        summary = json.loads(Path(tuned["runs"][0]["run_dir"], "summary.json").read_text())
        assert float(rows[row, "pooled"]["tuned_mean"]) == pytest.approx(
            100 * summary["selected_weighted"]["weighted"], abs=0.006)  # a weighted column reads selected_weighted
    assert rows["fedavg", "mean"]["tuned_vs_untuned_kendall_tau"] in ("1.00", "-1.00")
    # a per-client column reads each client's own validation-selected test accuracy (its personal model's early
    # stopping), never the mean over the clients: over all clients it is the run's own selected_per_client
    from pflkit.core.results.reproduce import _selected_clients

    run_dir = Path(comparison["fedavg tuned"]["runs"][0]["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert _selected_clients(run_dir, [0, 1, 2]) == pytest.approx(summary["selected_per_client"]["uniform"], abs=1e-12)
    assert float(rows["fedavg", "third"]["tuned_mean"]) == pytest.approx(100 * _selected_clients(run_dir, [2]),
                                                                         abs=0.006)


def test_every_installed_algorithms_ranges_are_values_its_options_accept():
    from pflkit.core.api import registry as reg

    for name in reg.ALGORITHMS.names():
        cfg = resolve([], algorithm=name)
        params = declared_params(cfg)
        for key, space in search_spaces(cfg, {}).items():
            assert space_problem(key, space, params[key]) is None, (name, key, space)
            for value in space.values_to_check():  # the whole configuration takes each end of the range
                resolve([{key.split(".")[0]: {key.split(".", 1)[1]: value}}], algorithm=name)


def test_an_algorithm_can_keep_an_option_it_does_not_use_out_of_the_search(registries_snapshot):
    from pflkit.core import Algorithm
    from pflkit.core.api import registry as reg

    reg.ALGORITHMS.register("fedprox-fixed-lr", Algorithm(trainer="fedprox", aggregator="fedavg",
                                                          searches={"train.lr": None,
                                                                    "train.momentum": Space.real(0.0, 0.9)}))
    cfg = resolve([], algorithm="fedprox-fixed-lr")
    assert list(search_spaces(cfg, {})) == ["train.local_epochs", "train.momentum", "trainer.mu"]
    assert "train.lr" in search_spaces(cfg, {"train.lr": "log:0.01..0.1"})  # --space outranks it
    reg.ALGORITHMS.register("fedprox-bad-range", Algorithm(trainer="fedprox", aggregator="fedavg",
                                                           searches={"train.lr": Space.real(-1.0, 1.0)}))
    with pytest.raises(ConfigError, match="fedprox-bad-range's search range"):
        search_spaces(resolve([], algorithm="fedprox-bad-range"), {})
    assert "train.lr" not in search_spaces(resolve([], algorithm="l2gd"), {})  # L2GD steps with its own alpha


def test_a_trial_is_never_pruned_at_its_last_round(tmp_path):
    # two rounds: the median pruner (from round 2, after 5 completed trials) could only stop a trial at its last one
    res = CliRunner().invoke(cli, ["tune", "-p", "fedavg", "--trials", "8", "--out", str(tmp_path), "--set",
                                   "rounds=2", *TINY[2:], "--space", "train.local_epochs=off"])
    assert res.exit_code == 0, res.output
    assert [r["state"] for r in _rows(tmp_path)] == ["complete"] * 8


def test_a_pruned_trial_stops_at_the_round_it_is_pruned(tmp_path):
    """The pruner's verdict pauses the run after that round (checkpointed): a pruned trial does not run to the end,
    and its run directory says where it stopped."""
    res = CliRunner().invoke(cli, ["tune", "-p", "fedavg", "--trials", "12", "--out", str(tmp_path), "--set",
                                   "rounds=8", *TINY[2:], "--space", "train.local_epochs=off", "--space",
                                   "train.lr=log:0.00001..0.5"])
    assert res.exit_code == 0, res.output
    rows = _rows(tmp_path)
    pruned = [r for r in rows if r["state"] == "pruned"]
    assert pruned, [(r["state"], r["train.lr"]) for r in rows]  # lr 1e-5 learns nothing: below the median
    for row in pruned:
        assert 1 < int(row["rounds"]) < 8, row
        assert f"pruned after round {row['rounds']}" == row["reason"]
        assert (Path(row["run_dir"]) / "checkpoint.pt").exists()
    assert all(int(r["rounds"]) == 8 for r in rows if r["state"] == "complete")


def test_a_run_pauses_after_the_round_its_on_round_callback_returns_true(tmp_path):
    from pflkit.core.engine.simulation import Simulation

    layers = [{"rounds": 4, "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [8]},
               "partition": {"num_clients": 3}, "checkpoint": {"every": 0}}]
    cfg = resolve(layers, algorithm="fedavg")
    summary = Simulation(cfg, run_dir=tmp_path / "r", progress=False, tensorboard=False).run(
        on_round=lambda record: record["round"] == 2)
    assert (summary["status"], summary["rounds_completed"]) == ("interrupted", 2)
    resumed = Simulation.resume(tmp_path / "r", progress=False, tensorboard=False).run(on_round=lambda record: 1)
    assert (resumed["status"], resumed["rounds_completed"]) == ("finished", 4)  # only True pauses


def test_ctrl_c_in_a_study_is_one_line_130_and_says_how_to_go_on(tmp_path, monkeypatch):
    """fl tune and fl compare --tune stopped by Ctrl-C while a study runs: 130 and how to continue, not click's
    generic line."""
    import pflkit.core.results.tuned as tuned
    import pflkit.core.results.tuning as tuning

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuning, "tune", interrupted)
    monkeypatch.setattr(tuned, "tune", interrupted)  # fl compare --tune's own reference
    res = CliRunner().invoke(cli, ["tune", "-p", "fedavg", "--trials", "2", "--out", str(tmp_path / "t"), *TINY])
    assert res.exit_code == 130 and "rerun the same command to continue the study in" in res.output, res.output
    res = CliRunner().invoke(cli, ["compare", "--plugins", "fedavg", "--tune", "2", "--out", str(tmp_path / "c"),
                                   *TINY])
    assert res.exit_code == 130, res.output
    assert f"rerun the same command to continue (the studies in {tmp_path / 'c' / 'tune'} go on" in res.output
    assert "Traceback" not in res.output and "Aborted" not in res.output
