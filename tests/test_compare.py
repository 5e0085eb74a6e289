"""fl compare / run_comparison: table, JSON and PNG are written and agree with the runs' own summaries."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.core.cli.compare import compare_command
from pflkit.core.compare import run_comparison
from pflkit.core.errors import CheckpointError, ConfigError, PflError, UnknownNameError
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


def test_interrupted_run_is_resumed(tmp_path):
    from pflkit.core import Simulation
    from pflkit.core.config import resolve

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
