"""fl compare / run_comparison: table, JSON and PNG are written and agree with the runs' own summaries."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.core.cli.compare import compare_command
from pflkit.core.results.compare import run_comparison
from pflkit.core.common.errors import CheckpointError, ConfigError, PflError, UnknownNameError
from pflkit.core.testing import TINY

ALGOS = ["fedavg", "local"]
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp")
    return out, run_comparison(ALGOS, SEEDS, [TINY], out)


def test_files_written(comparison):
    out, results = comparison
    for name in ("results.md", "results.json", "curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for algo in ALGOS:
        for seed in SEEDS:
            assert (out / "runs" / f"{algo}-seed{seed}" / "summary.json").is_file()
    assert json.loads((out / "results.json").read_text())["results"].keys() == set(ALGOS)


def test_numbers_match_run_summaries(comparison):
    out, results = comparison
    saved = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    for algo in ALGOS:
        summaries = [json.loads((out / "runs" / f"{algo}-seed{s}" / "summary.json").read_text()) for s in SEEDS]
        assert [s["seed"] for s in summaries] == SEEDS
        entry = saved["results"][algo]
        for stat, values in {
            "final_uniform": [s["final"]["uniform"] for s in summaries],
            "best_uniform": [s["best"]["uniform"] for s in summaries],
            "final_weighted": [s["final"]["weighted"] for s in summaries],
        }.items():
            assert entry[stat]["mean"] == pytest.approx(np.mean(values), abs=1e-12)
            assert entry[stat]["std"] == pytest.approx(np.std(values), abs=1e-12)
            assert entry[stat]["n"] == len(SEEDS)
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| {algo} |"))
        fu = entry["final_uniform"]
        assert f"{100 * fu['mean']:.2f} ± {100 * fu['std']:.2f}" in row
        # the curve ends at each run's last evaluation
        for run, summary in zip(entry["runs"], summaries):
            assert run["curve"]["rounds"] == [1, 2]
            assert run["curve"]["uniform"][-1] == pytest.approx(summary["last"]["accuracy/uniform"])
    # different algorithms and different seeds really differ
    assert saved["results"]["fedavg"]["final_uniform"]["mean"] != saved["results"]["local"]["final_uniform"]["mean"]
    assert saved["results"]["fedavg"]["final_uniform"]["std"] > 0


def test_finished_runs_are_reused_and_changed_config_refused(comparison):
    out, first = comparison
    summary = out / "runs" / "fedavg-seed0" / "summary.json"
    before = summary.stat().st_mtime_ns
    again = run_comparison(ALGOS, SEEDS, [TINY], out)
    assert summary.stat().st_mtime_ns == before
    assert again["results"]["fedavg"]["final_uniform"] == first["results"]["fedavg"]["final_uniform"]
    with pytest.raises(CheckpointError, match="fedavg-seed0"):
        run_comparison(ALGOS, SEEDS, [TINY, {"train": {"lr": 0.01}}], out)


def test_a_run_made_before_a_neutral_key_existed_is_still_reused(tmp_path):
    """A key added later (config.NEUTRAL_DEFAULTS: e.g. failures.client_timeout, aggregator.weighting) at its neutral
    value computes what the run computed, so the finished run is reused; a non-neutral value is a new config."""
    out = tmp_path / "cmp"
    run_comparison(["fedavg"], [0], [TINY], out)
    run = out / "runs" / "fedavg-seed0"
    saved = json.loads((run / "config.json").read_text())
    assert saved["failures"].pop("client_timeout", "absent") is None
    assert saved["aggregator"].pop("weighting") == "samples"
    (run / "config.json").write_text(json.dumps(saved))  # as a run of the previous version wrote it
    before = (run / "summary.json").stat().st_mtime_ns
    run_comparison(["fedavg"], [0], [TINY], out)
    assert (run / "summary.json").stat().st_mtime_ns == before
    with pytest.raises(CheckpointError, match="fedavg-seed0"):
        run_comparison(["fedavg"], [0], [TINY, {"aggregator": {"weighting": "uniform"}}], out)


def test_interrupted_run_is_resumed(tmp_path):
    from pflkit.core import Simulation
    from pflkit.core.engine.config import resolve

    cfg = resolve([TINY, {"seed": 0}], algorithm="fedavg")
    run_dir = tmp_path / "runs" / "fedavg-seed0"
    partial = Simulation(cfg, run_dir=run_dir, tensorboard=False).run(stop_after=1)
    assert partial["interrupted"] and partial["rounds_completed"] == 1
    results = run_comparison(["fedavg"], [0], [TINY], tmp_path)
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["rounds_completed"] == 2 and not resumed["interrupted"]
    assert results["results"]["fedavg"]["final_uniform"]["mean"] == resumed["final"]["uniform"]
    uninterrupted = run_comparison(["fedavg"], [0], [TINY], tmp_path / "fresh")
    assert uninterrupted["results"]["fedavg"]["final_uniform"] == results["results"]["fedavg"]["final_uniform"]


def test_input_errors_are_pfl_errors_raised_before_running(tmp_path):
    with pytest.raises(UnknownNameError, match="fedavgg"):
        run_comparison(["fedavg", "fedavgg"], [0], [TINY], tmp_path / "a")
    assert not (tmp_path / "a" / "runs").exists()
    with pytest.raises(ConfigError, match="train.lrr"):
        run_comparison(["fedavg"], [0], [TINY, {"train": {"lrr": 0.1}}], tmp_path / "b")
    with pytest.raises(ConfigError, match="twice"):
        run_comparison(["fedavg", "fedavg"], [0], [TINY], tmp_path / "c")
    with pytest.raises(ConfigError, match="not among"):
        run_comparison(["fedavg"], [0], [TINY], tmp_path / "d", algorithm_layers={"local": [{}]})
    assert issubclass(UnknownNameError, PflError)


def test_cli_command(tmp_path):
    runner = CliRunner()
    tiny = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
            "--set", "model.hidden=[16]", "--set", "checkpoint.every=0", "--set", "device=cpu"]
    res = runner.invoke(compare_command, ["--plugins", "fedavg,local", "--seeds", "3", "--out", str(tmp_path / "o"),
                                          "--no-progress", *tiny])
    assert res.exit_code == 0, res.output
    assert "| fedavg |" in res.output and (tmp_path / "o" / "curves.png").is_file()
    assert json.loads((tmp_path / "o" / "runs" / "local-seed3" / "config.json").read_text())["seed"] == 3

    bad = runner.invoke(compare_command, ["--plugins", "fedavg", "--out", str(tmp_path / "x"), "--set", "oops"])
    assert bad.exit_code == 2 and "expected key=value" in bad.output and "Traceback" not in bad.output
    bad = runner.invoke(compare_command, ["--plugins", "nope", "--out", str(tmp_path / "y")])
    assert bad.exit_code == 2 and "unknown algorithm 'nope'" in bad.output
    bad = runner.invoke(compare_command, ["--plugins", "fedavg", "--seeds", "0,x", "--out", str(tmp_path / "z")])
    assert bad.exit_code == 2 and "--seeds" in bad.output


def test_variants_are_labelled_rows_with_their_settings(tmp_path):
    specs = ["fedavg", "fedavg+train.lr=0.05", "fedavg+train.lr=0.05+train.local_epochs=2"]
    results = run_comparison(specs, [0], [TINY], tmp_path, algorithm_layers={"fedavg": [{"train": {"lr": 0.2}}]})
    assert results["algorithms"] == specs
    configs = {}
    for spec in specs:
        entry = results["results"][spec]
        assert entry["algorithm"] == "fedavg" and len(entry["runs"]) == 1
        run_dir = tmp_path / "runs" / f"{spec}-seed0"
        assert entry["runs"][0]["run_dir"] == str(run_dir)
        configs[spec] = json.loads((run_dir / "config.json").read_text())
    # ALGO:key=value applies to every variant of ALGO; the variant's own setting outranks it
    assert configs["fedavg"]["train"]["lr"] == 0.2 and configs["fedavg"]["train"]["local_epochs"] == 1
    assert configs["fedavg+train.lr=0.05"]["train"]["lr"] == 0.05
    assert configs["fedavg+train.lr=0.05"]["train"]["local_epochs"] == 1
    assert configs["fedavg+train.lr=0.05+train.local_epochs=2"]["train"]["local_epochs"] == 2
    assert results["results"]["fedavg+train.lr=0.05"]["settings"] == {"train": {"lr": 0.05}}
    finals = [results["results"][s]["final_uniform"]["mean"] for s in specs]
    assert len(set(finals)) == 3  # the settings really changed the runs
    table = (tmp_path / "results.md").read_text()
    for spec in specs:
        assert f"| {spec} |" in table


def test_partition_seed_and_list_valued_variant_get_safe_directories(tmp_path):
    spec = "fedavg+participation.random_join_ratio=[0.5,1]"
    results = run_comparison(["fedavg", spec], [0, 1], [TINY, {"partition": {"seed": 7}}], tmp_path)
    run_dir = tmp_path / "runs" / "fedavg+participation.random_join_ratio=_0.5_1-seed1"
    assert results["results"][spec]["runs"][1]["run_dir"] == str(run_dir)
    assert json.loads((run_dir / "config.json").read_text())["participation"]["random_join_ratio"] == [0.5, 1]
    # one partition for every run seed
    parts = {(tmp_path / "runs" / f"fedavg-seed{s}" / "partition.json").read_text() for s in (0, 1)}
    assert len(parts) == 1
    assert "partition seed 7" in (tmp_path / "results.md").read_text()


def test_parallel_jobs_give_the_serial_numbers(tmp_path):
    serial = run_comparison(ALGOS, SEEDS, [TINY], tmp_path / "serial", jobs=1)
    parallel = run_comparison(ALGOS, SEEDS, [TINY], tmp_path / "parallel", jobs=2)
    for algo in ALGOS:
        for a, b in zip(serial["results"][algo]["runs"], parallel["results"][algo]["runs"]):
            assert a["seed"] == b["seed"]
            for key in ("final_uniform", "best_uniform", "final_weighted", "best_round", "bytes_up_total"):
                assert a[key] == b[key], (algo, a["seed"], key)
            assert a["curve"] == b["curve"]
    # a parallel rerun reuses every finished run
    summary = tmp_path / "parallel" / "runs" / "local-seed1" / "summary.json"
    before = summary.stat().st_mtime_ns
    again = run_comparison(ALGOS, SEEDS, [TINY], tmp_path / "parallel", jobs=2)
    assert summary.stat().st_mtime_ns == before
    assert again["results"]["local"]["final_uniform"] == parallel["results"]["local"]["final_uniform"]


@pytest.mark.parametrize("spec, message", [
    ("fedavg+oops", "'oops' is not key=value"),
    ("fedavg+=3", "is not key=value"),
    ("+train.lr=0.1", "is not ALGORITHM"),
    ("fedavg+train.lrr=0.1", "train.lrr"),
    ("fedavgg+train.lr=0.1", "fedavgg"),
])
def test_malformed_variant_specs_are_clear_errors(tmp_path, spec, message):
    with pytest.raises(PflError, match=re.escape(message)):
        run_comparison(["fedavg", spec], [0], [TINY], tmp_path)
    assert not (tmp_path / "runs").exists()
    runner = CliRunner()
    res = runner.invoke(compare_command, ["--plugins", f"fedavg,{spec}", "--out", str(tmp_path / "cli"),
                                          "--no-progress"])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_cli_variants_with_list_values_and_jobs(tmp_path):
    runner = CliRunner()
    tiny = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
            "--set", "model.hidden=[16]", "--set", "checkpoint.every=0", "--set", "device=cpu"]
    spec = "fedavg+participation.random_join_ratio=[0.5,1]+train.lr=0.02"
    res = runner.invoke(compare_command, ["--plugins", f"fedavg,{spec}", "--seeds", "0", "--jobs", "2",
                                          "--out", str(tmp_path / "o"), "--no-progress", *tiny])
    assert res.exit_code == 0, res.output
    assert f"| {spec} |" in res.output
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    assert saved["algorithms"] == ["fedavg", spec] and saved["jobs"] == 2
    cfg = json.loads(Path(saved["results"][spec]["runs"][0]["run_dir"], "config.json").read_text())
    assert cfg["participation"]["random_join_ratio"] == [0.5, 1] and cfg["train"]["lr"] == 0.02
    bad = runner.invoke(compare_command, ["--plugins", "fedavg", "--jobs", "0", "--out", str(tmp_path / "j")])
    assert bad.exit_code == 2 and "--jobs" in bad.output


def test_serial_runs_use_one_torch_thread_and_restore_it(tmp_path, monkeypatch):
    import torch

    import pflkit.core.results.compare as compare

    seen = []
    real = compare._execute

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "_execute", recording)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_comparison(["fedavg"], [0, 1], [TINY], tmp_path, jobs=1)
        assert seen == [1, 1]  # as in the --jobs N workers, so --jobs does not change the numbers
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


# --- issue 16 item 3: failed and incomplete runs, rejected clients, progress lines, exit status ---------------

TINY_CLI = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
            "--set", "model.hidden=[16]", "--set", "checkpoint.every=0", "--set", "device=cpu", "--no-progress"]


def _faulty(registries_snapshot):
    from pflkit.core import LocalSGDTrainer

    class AlwaysRaises(LocalSGDTrainer):
        def local_update(self):
            raise RuntimeError("broken everywhere")

    class NaNOnClientOne(LocalSGDTrainer):
        def local_update(self):
            loss = super().local_update()
            if self.ctx.cid == 1:
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("nan"))
            return loss

    registries_snapshot.TRAINERS.register("always_raises", AlwaysRaises)
    registries_snapshot.TRAINERS.register("nan_one", NaNOnClientOne)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path, registries_snapshot, jobs):
    _faulty(registries_snapshot)
    broken = "fedavg+trainer.name=always_raises"
    lines = []
    results = run_comparison([broken, "local"], [0], [TINY], tmp_path, jobs=jobs, echo=lines.append)
    assert results["complete"] is False and not results["interrupted"]
    [failed] = results["not_in_table"]
    assert failed["label"] == broken and failed["status"] == "failed" and failed["rounds_completed"] == 0
    assert failed["reason"].startswith("every selected client failed in round 1")
    assert "broken everywhere" in failed["reason"] and "\n" not in failed["reason"]
    assert results["results"][broken]["runs"] == [] and results["results"][broken]["final_uniform"]["n"] == 0
    local = json.loads((tmp_path / "runs" / "local-seed0" / "summary.json").read_text())
    assert results["results"]["local"]["final_uniform"]["mean"] == local["final"]["uniform"]  # it still ran
    # one progress line per run, in the order they ended
    assert len(lines) == 2 and all(re.match(r"\[[12]/2\] ", ln) for ln in lines)
    assert any(f"{broken} seed 0: FAILED after 0/2 rounds: every selected client" in ln for ln in lines)
    assert any("local seed 0: finished 2/2 rounds, final accuracy" in ln for ln in lines)
    table = (tmp_path / "results.md").read_text()
    assert f"| {broken} | n/a |" in table and "0 of 1" in table
    assert f"- {broken}, seed 0: FAILED after 0 of 2 rounds (every selected client failed" in table


def test_cli_exit_status_1_and_progress_lines_with_jobs(tmp_path, registries_snapshot):
    _faulty(registries_snapshot)
    runner = CliRunner()
    res = runner.invoke(compare_command, ["--plugins", "fedavg+trainer.name=always_raises,fedavg", "--jobs", "2",
                                          "--out", str(tmp_path / "o"), *TINY_CLI])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "1 run(s) not in the table (1 failed, 0 incomplete)" in res.output
    progress = [ln for ln in res.output.splitlines() if re.match(r"\[\d/2\] ", ln)]
    assert len(progress) == 2
    assert res.output.index(progress[-1]) < res.output.index("| algorithm |")  # printed as runs end, before the table
    ok = runner.invoke(compare_command, ["--plugins", "fedavg", "--jobs", "2", "--seeds", "0,1",
                                         "--out", str(tmp_path / "ok"), *TINY_CLI])
    assert ok.exit_code == 0, ok.output
    assert "[1/2] fedavg seed" in ok.output and "[2/2] fedavg seed" in ok.output


def test_clients_rejected_for_nan_are_counted(tmp_path, registries_snapshot):
    _faulty(registries_snapshot)
    spec = "fedavg+trainer.name=nan_one"
    lines = []
    results = run_comparison([spec, "fedavg"], [0, 1], [TINY], tmp_path, echo=lines.append)
    assert results["complete"]
    per_run = [json.loads((tmp_path / "runs" / f"{spec}-seed{s}" / "summary.json").read_text())["client_failures"]
               for s in (0, 1)]
    assert per_run == [2, 2]  # client 1 rejected in each of the 2 rounds
    assert results["results"][spec]["client_failures"] == 4 and results["results"]["fedavg"]["client_failures"] == 0
    assert [r["client_failures"] for r in results["results"][spec]["runs"]] == [2, 2]
    row = next(ln for ln in (tmp_path / "results.md").read_text().splitlines() if ln.startswith(f"| {spec} |"))
    assert row.endswith("| 4 |")
    assert sum("2 client replies rejected" in ln for ln in lines) == 2


def test_incomplete_runs_are_left_out_of_the_statistics_and_fail_the_cli(tmp_path, monkeypatch):
    import pflkit.core.results.compare as compare
    from pflkit.core import Simulation

    real = compare._execute

    def interrupted_on_seed1(cfg, run_dir, state, progress, *rest):
        if run_dir.name.endswith("seed1"):  # as a Ctrl-C after round 1 would leave it
            return Simulation(cfg, run_dir=run_dir, tensorboard=False).run(stop_after=1)
        return real(cfg, run_dir, state, progress, *rest)

    monkeypatch.setattr(compare, "_execute", interrupted_on_seed1)
    runner = CliRunner()
    sets = [*TINY_CLI, "--set", "checkpoint.every=1"]
    res = runner.invoke(compare_command, ["--plugins", "fedavg", "--seeds", "0,1,2", "--out", str(tmp_path),
                                          *sets])
    assert res.exit_code == 130, res.output  # interrupted, as fl run after Ctrl-C
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["interrupted"] and not results["complete"]
    seed0 = json.loads((tmp_path / "runs" / "fedavg-seed0" / "summary.json").read_text())
    entry = results["results"]["fedavg"]
    assert [r["seed"] for r in entry["runs"]] == [0]
    assert entry["final_uniform"] == {"mean": seed0["final"]["uniform"], "std": 0.0, "n": 1}  # seed 1 not averaged in
    assert [(r["seed"], r["status"], r["rounds_completed"], r["reason"]) for r in results["not_in_table"]] == [
        (1, "incomplete", 1, "interrupted"), (2, "incomplete", 0, "not started")]
    assert "| fedavg |" in res.output and "| 1 of 3 |" in res.output
    assert "- fedavg, seed 1: incomplete after 1 of 2 rounds (interrupted)" in res.output
    assert "[2/3] fedavg seed 1: incomplete, 1/2 rounds" in res.output
    assert "rerun the same command to continue" in res.output
    # rerunning finishes the comparison: seed 0 reused, seed 1 resumed, seed 2 run
    monkeypatch.setattr(compare, "_execute", real)
    again = runner.invoke(compare_command, ["--plugins", "fedavg", "--seeds", "0,1,2", "--out", str(tmp_path),
                                            *sets])
    assert again.exit_code == 0, again.output
    assert "[1/3] fedavg seed 0: reused, finished earlier: 2/2 rounds" in again.output
    assert json.loads((tmp_path / "results.json").read_text())["results"]["fedavg"]["final_uniform"]["n"] == 3
