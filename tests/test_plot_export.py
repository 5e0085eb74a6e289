"""fl plot / fl export: curves and one CSV table from existing run directories, without rerunning anything."""
import csv
import io
import json
import shutil

import pytest
from click.testing import CliRunner

from pflkit.core import Simulation
from pflkit.core.cli.main import cli
from pflkit.core.engine.config import resolve
from pflkit.core.storage.rundata import load_run, load_runs
from pflkit.core.results.runplot import _band
from pflkit.core.testing import TINY


def fl(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fedavg (3 rounds, evaluated every 2: rounds 2 and 3), local (3 rounds), and fedavg stopped after round 1."""
    root = tmp_path_factory.mktemp("runs")
    full = resolve([TINY, {"rounds": 3, "eval": {"every": 2}}], algorithm="fedavg")
    Simulation(full, run_dir=root / "fedavg", tensorboard=False).run()
    Simulation(resolve([TINY, {"rounds": 3}], algorithm="local"), run_dir=root / "local", tensorboard=False).run()
    Simulation(resolve([TINY, {"rounds": 3}], algorithm="fedavg"), run_dir=root / "cut",
               tensorboard=False).run(stop_after=1)
    return root


def records(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_csv(path):
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_export_writes_every_round_of_every_run_as_one_table(runs, tmp_path):
    out = tmp_path / "m.csv"
    res = fl("export", runs / "fedavg", runs / "local", "--csv", out, "--key", "train.lr", "--key", "rounds")
    assert res.exit_code == 0, res.output
    rows = read_csv(out)
    assert [(r["run"], r["round"]) for r in rows] == [("fedavg", "1"), ("fedavg", "2"), ("fedavg", "3"),
                                                     ("local", "1"), ("local", "2"), ("local", "3")]
    assert {r["algorithm"] for r in rows} == {"fedavg", "local"} and {r["rounds"] for r in rows} == {"3"}
    for name in ("fedavg", "local"):
        mine = [r for r in rows if r["run"] == name]
        for row, rec in zip(mine, records(runs / name)):
            assert float(row["train_loss"]) == rec["train_loss"]
            if "accuracy/uniform" in rec:
                assert float(row["accuracy/uniform"]) == rec["accuracy/uniform"]
            else:
                assert row["accuracy/uniform"] == ""  # fedavg did not evaluate round 1: an empty cell
            # each client's metric and test samples (objects in the record) are cells of JSON text
            for key in ("per_client", "per_client_samples"):
                assert (json.loads(row[key]) == rec[key]) if key in rec else row[key] == ""
    assert rows[0]["accuracy/uniform"] == "" and rows[3]["accuracy/uniform"] != ""
    assert "6 rows" in res.output


def test_export_summary_has_one_row_per_run_with_its_status(runs, tmp_path):
    res = fl("export", runs / "fedavg", runs / "local", runs / "cut", "--csv", "-", "--summary")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert [r["run"] for r in rows] == ["fedavg", "local", "cut"]
    for row in rows[:2]:
        summary = json.loads((runs / row["run"] / "summary.json").read_text())
        assert row["status"] == "finished" and float(row["final_uniform"]) == summary["final"]["uniform"]
        assert float(row["best_uniform"]) == summary["best"]["uniform"]
        assert int(row["best_round"]) == summary["best"]["round"]
    assert rows[2]["status"] == "interrupted" and rows[2]["rounds_logged"] == "1" and rows[2]["rounds"] == "3"


def test_plot_draws_uniform_weighted_and_the_client_spread(runs, tmp_path):
    for band in ("p10-p90", "min-max", "std", "none"):
        out = tmp_path / f"c-{band}.png"
        res = fl("plot", runs / "fedavg", runs / "local", runs / "cut", "--out", out, "--band", band)
        assert res.exit_code == 0, res.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "3 run(s)" in res.output and "note: cut is not finished (interrupted, 1 rounds logged)" in res.output
    run = load_run(runs / "local")
    recs = records(runs / "local")
    rounds, lo, hi = _band(run, "accuracy", "p10-p90")
    assert rounds == [1, 2, 3] and lo == [r["accuracy/p10"] for r in recs] and hi == [r["accuracy/p90"] for r in recs]
    rounds, lo, hi = _band(run, "accuracy", "std")
    assert lo == [r["accuracy/uniform"] - r["accuracy/std"] for r in recs]
    assert _band(load_run(runs / "fedavg"), "accuracy", "min-max")[0] == [2, 3]  # only the evaluated rounds
    pdf = tmp_path / "c.pdf"
    assert fl("plot", runs / "local", "--out", pdf).exit_code == 0 and pdf.read_bytes()[:4] == b"%PDF"


def test_same_folder_names_get_distinct_labels(runs, tmp_path):
    for parent in ("x", "y"):
        shutil.copytree(runs / "local", tmp_path / parent / "local")
    assert [r.label for r in load_runs([tmp_path / "x" / "local", tmp_path / "y" / "local"])] == ["x/local",
                                                                                                   "y/local"]


def test_a_half_written_last_line_is_skipped(runs, tmp_path):
    shutil.copytree(runs / "local", tmp_path / "r")
    with (tmp_path / "r" / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "train_lo')
    assert [r["round"] for r in load_run(tmp_path / "r").records] == [1, 2, 3]


def test_bad_input_is_one_line_and_status_2(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    damaged = tmp_path / "damaged"
    shutil.copytree(runs / "local", damaged)
    lines = (damaged / "metrics.jsonl").read_text().splitlines()
    (damaged / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    cases = [
        (["plot", tmp_path / "nope"], "does not exist"),
        (["plot", tmp_path], "is not a run directory (no metrics.jsonl)"),
        (["export", empty, "--csv", tmp_path / "e.csv"], "holds no round yet"),
        (["export", damaged, "--csv", tmp_path / "d.csv"], "line 2 is not JSON"),
        (["export", runs / "local", runs / "local", "--csv", tmp_path / "t.csv"], "given twice"),
        (["export", runs / "local", "--csv", tmp_path / "k.csv", "--key", "train.lrr"], "Did you mean 'train.lr'"),
        (["export", runs / "local", "--csv", tmp_path / "no" / "such" / "x.csv"], "cannot write"),
        (["plot", runs / "local", "--out", tmp_path / "c.xyz"], "Format 'xyz' is not supported"),
        (["plot", runs / "cut", "--out", tmp_path / "c.png", "--band", "iqr"], "Invalid value for '--band'"),
        (["plot"], "Missing argument"),
    ]
    for args, fragment in cases:
        res = fl(*args)
        assert res.exit_code == 2, (args, res.output)
        assert fragment in res.output and "Traceback" not in res.output, (args, res.output)
    assert not (tmp_path / "e.csv").exists() and not (tmp_path / "k.csv").exists()
