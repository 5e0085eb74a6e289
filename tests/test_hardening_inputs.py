"""Hostile inputs to the commands that read what others wrote (issue 21, item 4): run directories read by
``fl plot`` / ``fl export`` / ``fl compare``, config files, ``--set`` values, names; and the output files those
commands write. Each ends in one clear line with exit status 2 (or the documented behaviour asserted here), never
a traceback, a hang, unbounded memory or a half-written file.

Run-file refusals stop the whole command (not a skipped run): a table or plot silently missing one of the named
runs would be taken for the whole picture (README, "Plotting and exporting existing runs").
"""
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from pflkit.core import Simulation
from pflkit.core.storage import rundata
from pflkit.core.cli.main import cli
from pflkit.core.engine.config import resolve
from pflkit.core.results.runplot import band_alpha, legend_outside
from pflkit.core.testing import TINY

TINY_SETS = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
             "--set", "model.hidden=[16]", "--set", "checkpoint.every=0"]


def fl(*args, **kwargs):
    return CliRunner(**kwargs).invoke(cli, [str(a) for a in args], catch_exceptions=False)


def one_clear_line(res, fragment, status=2):
    assert res.exit_code == status, res.output
    assert "Traceback" not in res.output
    assert fragment in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("Error:")]) == 1
    assert max(len(ln) for ln in res.output.splitlines()) < 1000, "the error line must stay readable"


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of hanging (a FIFO read that blocks would hang the test run forever)."""
    def expired(*_):
        raise AssertionError(f"still running after {seconds} s: the command hangs")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-round run directory (copied before each tampering)."""
    root = tmp_path_factory.mktemp("runs")
    Simulation(resolve([TINY], algorithm="fedavg"), run_dir=root / "r", tensorboard=False).run()
    return root / "r"


@pytest.fixture
def run(finished, tmp_path):
    dst = tmp_path / "r"
    shutil.copytree(finished, dst)
    return dst


def records(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_records(run_dir, recs):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def export_and_plot(run_dir, tmp_path):
    """Both readers of a run directory: ``fl export`` and ``fl plot``."""
    yield fl("export", run_dir, "--csv", tmp_path / "m.csv", "--summary")
    yield fl("export", run_dir, "--csv", tmp_path / "m.csv")
    yield fl("plot", run_dir, "--out", tmp_path / "c.png")


# -- run files that are not regular files, or too large ----------------------------------------------------------
@pytest.mark.parametrize("name", ["summary.json", "config.json", "metrics.jsonl"])
def test_run_file_linked_to_dev_zero_is_refused(run, tmp_path, name):
    (run / name).unlink()
    os.symlink("/dev/zero", run / name)
    with deadline(20):
        for res in export_and_plot(run, tmp_path):
            one_clear_line(res, f"{run / name} is a symbolic link")


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl"])
def test_run_file_that_is_a_fifo_does_not_hang(run, tmp_path, name):
    (run / name).unlink()
    os.mkfifo(run / name)
    with deadline(20):
        for res in export_and_plot(run, tmp_path):
            one_clear_line(res, f"{run / name} is a FIFO")


@pytest.mark.parametrize("name, limit", [("summary.json", "JSON_LIMIT"), ("metrics.jsonl", "METRICS_LIMIT")])
def test_oversized_run_file_is_refused(run, tmp_path, monkeypatch, name, limit):
    monkeypatch.setattr(rundata, limit, 256)  # the real limits (16 MiB, 256 MiB) are too large for a fast test
    one_clear_line(fl("export", run, "--csv", tmp_path / "m.csv"), "more than the 256 bytes")


# -- what the run files say ----------------------------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def _summary(run_dir, **changes):
    doc = json.loads((run_dir / "summary.json").read_text())
    doc.update(changes)
    (run_dir / "summary.json").write_text(json.dumps(doc))


def _damage(run_dir, case):
    if case == "deep summary":
        (run_dir / "summary.json").write_text(DEEP)
    elif case == "deep config":
        (run_dir / "config.json").write_text('{"a": ' + "[" * 40 + "]" * 40 + "}")
    elif case == "deep metrics line":
        recs = records(run_dir)
        recs[0]["x"] = json.loads("[" * 40 + "]" * 40)
        write_records(run_dir, recs)
    elif case == "deep metrics line (parser limit)":
        (run_dir / "metrics.jsonl").write_text(DEEP + "\n" + (run_dir / "metrics.jsonl").read_text())
    elif case == "duplicate key in summary":
        text = (run_dir / "summary.json").read_text()
        (run_dir / "summary.json").write_text(text.replace('"metric": "accuracy"',
                                                           '"metric": "accuracy", "metric": "loss"'))
    elif case == "duplicate key in config":
        (run_dir / "config.json").write_text('{"seed": 0, "seed": 1}')
    elif case == "duplicate key in metrics line":
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        lines[0] = lines[0].replace('"round": 1,', '"round": 1, "round": 2,')
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    elif case == "final is a list":
        _summary(run_dir, final=[1, 2])
    elif case == "number as a string":
        _summary(run_dir, best={"uniform": "0.9", "round": 2})
    elif case == "rounds_completed as a string":
        _summary(run_dir, rounds_completed="2")
    elif case == "metric is a list":
        _summary(run_dir, metric=["accuracy"])
    elif case == "metric name of 1 MB":
        _summary(run_dir, metric="m" * 1_000_000)
    elif case == "interrupted as a number":
        _summary(run_dir, interrupted=3)
    elif case == "summary is a list":
        (run_dir / "summary.json").write_text("[1, 2]")
    elif case == "metrics line is a list":
        (run_dir / "metrics.jsonl").write_text("[1, 2]\n" + (run_dir / "metrics.jsonl").read_text())
    elif case == "round as a string":
        recs = records(run_dir)
        recs[0]["round"] = "1"
        write_records(run_dir, recs)
    elif case == "round true":
        recs = records(run_dir)
        recs[0]["round"] = True
        write_records(run_dir, recs)
    elif case == "negative round":
        recs = records(run_dir)
        recs[0]["round"] = -5
        write_records(run_dir, recs)
    elif case == "non-UTF-8 summary":
        (run_dir / "summary.json").write_bytes(b'{"metric": "caf\xe9"}')
    else:  # pragma: no cover
        raise AssertionError(case)


@pytest.mark.parametrize("case, fragment", [
    ("deep summary", "nested more than 32 levels deep"),
    ("deep config", "nested more than 32 levels deep"),
    ("deep metrics line", "line 1 is refused: nested more than 32 levels deep"),
    ("deep metrics line (parser limit)", "line 1 is refused: nested more than 32 levels deep"),
    ("duplicate key in summary", "duplicate key 'metric'"),
    ("duplicate key in config", "duplicate key 'seed'"),
    ("duplicate key in metrics line", "line 1 is refused: duplicate key 'round'"),
    ("final is a list", "'final' is list, expected an object"),
    ("number as a string", "'best.uniform' is str, expected a number or null"),
    ("rounds_completed as a string", "'rounds_completed' is str, expected a round number"),
    ("metric is a list", "'metric' is list, expected a name of 1-64 characters"),
    ("metric name of 1 MB", "'metric' is str, expected a name of 1-64 characters"),
    ("interrupted as a number", "'interrupted' is int, expected true or false"),
    ("summary is a list", "not a JSON object"),
    ("metrics line is a list", "line 1 is not a round record"),
    ("round as a string", "line 1 is not a round record"),
    ("round true", "line 1 is not a round record"),
    ("negative round", "line 1 is not a round record"),
    ("non-UTF-8 summary", "is not UTF-8 text"),
])
def test_hostile_run_file_contents_are_one_line(run, tmp_path, case, fragment):
    _damage(run, case)
    for res in export_and_plot(run, tmp_path):
        one_clear_line(res, fragment)
    assert not (tmp_path / "m.csv").exists() and not (tmp_path / "c.png").exists()


def test_odd_values_that_are_still_data_are_documented_cells(run, tmp_path):
    """Values of other types where the commands only show them: a config section that is a string gives an empty
    dataset cell, a metric that is a list is a JSON cell and no point of a curve, a count that is text does not
    break the failure sum of a run without summary."""
    (run / "config.json").write_text(json.dumps({"algorithm": "fedavg", "dataset": "digits", "seed": [0]}))
    recs = records(run)
    recs[1]["accuracy/p10"] = [0.1, 0.2]
    recs[1]["client_failures"] = "many"
    recs[1]["train_loss"] = 10 ** 400  # beyond float range
    write_records(run, recs)
    (run / "summary.json").unlink()
    res = fl("export", run, "--csv", "-", "--summary")
    assert res.exit_code == 0, res.output
    row = next(csv.DictReader(io.StringIO(res.output)))
    assert row["dataset"] == "" and row["seed"] == "[0]" and row["client_failures"] == "0"
    res = fl("export", run, "--csv", "-")
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert rows[1]["accuracy/p10"] == "[0.1, 0.2]" and rows[1]["train_loss"] == str(10 ** 400)
    res = fl("plot", run, "--out", tmp_path / "c.png", "--band", "p10-p90")
    assert res.exit_code == 0, res.output


# -- speed ---------------------------------------------------------------------------------------------------------
def test_a_record_with_60000_keys_is_exported_and_plotted_in_linear_time(run, tmp_path):
    recs = records(run)
    recs[0].update({f"extra/{i}": i * 0.5 for i in range(60_000)})
    write_records(run, recs)
    start = time.process_time()  # CPU time: the shared test machine's load does not count
    res = fl("export", run, "--csv", tmp_path / "m.csv")
    assert res.exit_code == 0, res.output
    res = fl("plot", run, "--out", tmp_path / "c.png")
    assert res.exit_code == 0, res.output
    elapsed = time.process_time() - start
    assert elapsed < 10, f"{elapsed:.1f} s of CPU (the quadratic merge took 34.6 s for the export alone)"
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    assert len(header) > 60_000 and header[-1] == "extra/59999"


# -- what fl export writes -------------------------------------------------------------------------------------
def test_csv_cells_that_a_spreadsheet_would_evaluate_are_neutralised(run, tmp_path):
    cfg = json.loads((run / "config.json").read_text())
    cfg["algorithm"] = '=HYPERLINK("http://x","y")'
    cfg["dataset"]["name"] = "@SUM(1+1)"
    (run / "config.json").write_text(json.dumps(cfg))
    recs = records(run)
    recs[0]["+cmd|' /C calc'!A0"] = "-2+3"
    recs[0]["note"] = "\tTAB"
    recs[0]["train_loss"] = -1.5  # a negative number stays a number
    write_records(run, recs)
    res = fl("export", run, "--csv", "-")
    assert res.exit_code == 0, res.output
    rows = list(csv.reader(io.StringIO(res.output)))
    header, first = rows[0], dict(zip(rows[0], rows[1]))
    assert "'+cmd|' /C calc'!A0" in header
    assert first["algorithm"] == "'=HYPERLINK(\"http://x\",\"y\")" and first["dataset"] == "'@SUM(1+1)"
    assert first["'+cmd|' /C calc'!A0"] == "'-2+3" and first["note"] == "'\tTAB"
    assert first["train_loss"] == "-1.5"
    assert not any(cell.startswith(("=", "+", "@", "\t", "\r")) for row in rows for cell in row)


def test_export_writes_counts_as_integers(run):
    res = fl("export", run, "--csv", "-")
    row = next(csv.DictReader(io.StringIO(res.output)))
    assert records(run)[0]["clients_selected"] == 4.0  # the monitor logs floats ...
    for key in ("round", "clients_selected", "clients_replied", "bytes_up", "bytes_down", "clients_evaluated",
                "client_failures"):
        assert row[key].isdigit(), (key, row[key])  # ... the table shows counts as integers
    assert "." in row["accuracy/min"] or "e" in row["accuracy/min"]  # a metric of 0 stays a float (0.0)
    res = fl("export", run, "--csv", "-", "--summary")
    row = next(csv.DictReader(io.StringIO(res.output)))
    for key in ("rounds_logged", "rounds", "best_round", "final_k", "bytes_up_total", "client_failures"):
        assert row[key].isdigit(), (key, row[key])


def test_export_to_a_closed_stdout_is_one_line(run):
    cmd = [sys.executable, "-c", "from pflkit.core.cli.main import main; main()", "export", str(run), "--csv", "-"]
    res = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(1))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["Error: --csv -: cannot write to standard output (it is closed)"]


@pytest.mark.parametrize("command", ["plot", "export"])
@pytest.mark.parametrize("target", ["/dev/full", "fifo", "link"])
def test_output_that_is_not_a_regular_file_is_refused_and_nothing_half_written(run, tmp_path, command, target):
    if target == "fifo":
        target = tmp_path / "fifo.png"
        os.mkfifo(target)
    elif target == "link":
        (tmp_path / "victim.png").write_bytes(b"keep")
        target = tmp_path / "out.png"
        os.symlink(tmp_path / "victim.png", target)
    args = ["plot", run, "--out", target] if command == "plot" else ["export", run, "--csv", target]
    with deadline(30):
        one_clear_line(fl(*args), "not a regular file")
    if (tmp_path / "victim.png").exists():
        assert (tmp_path / "victim.png").read_bytes() == b"keep"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_failed_write_keeps_the_previous_file_whole(run, tmp_path, monkeypatch):
    out = tmp_path / "m.csv"
    out.write_text("previous\n")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full_disk)
    one_clear_line(fl("export", run, "--csv", out), "--csv")
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv", "r"]  # no temporary file left behind


# -- fl plot / fl compare figures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("figsize, title", [((12, 4.4), None), ((11, 4.2), "digits: mean over seeds 0, 1, 2")],
                         ids=["fl-plot", "fl-compare"])
def test_legends_are_outside_the_axes_and_bands_get_lighter(figsize, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, _) = plt.subplots(1, 2, figsize=figsize)  # fl plot's figure, fl compare's (with its title)
    for i in range(12):
        ax.plot([1, 2, 3], [i, i + 1, i + 2], label=f"run-{i} uniform")
    ax.set_xlabel("round")
    legend_outside(ax)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()  # as fl plot and fl compare do
    fig.canvas.draw()
    box, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert box.y1 <= frame.y0, "the legend overlaps the plotted area"
    assert box.y1 <= ax.xaxis.label.get_window_extent().y0, "the legend covers the axis label"
    plt.close(fig)
    assert band_alpha(1) == 0.2 and band_alpha(4) < 0.1 and band_alpha(100) == 0.04
    assert all(band_alpha(n + 1) <= band_alpha(n) for n in range(1, 30))


# -- configs, --set values and names -----------------------------------------------------------------------------
BIG_NAME = "n" * 10_000_000


@pytest.mark.parametrize("sets, fragment", [
    (["train.lr=inf"], "train.lr: inf is invalid: must be a finite number"),
    (["train.lr=-Infinity"], "train.lr: -inf is invalid: must be a finite number"),
    (["train.momentum=nan"], "train.momentum: nan is invalid: must be a finite number"),
    ([f"threads={2 ** 31}"], "threads: 2147483648 is invalid: must lie in [1, 1024]"),
    (["threads=100000"], "threads: 100000 is invalid"),
    (["run_name=a\nb"], "run_name: 'a\\nb' is invalid: must not contain a newline"),
    (["run_name=tab\there"], "must not contain a newline, tab or other control character"),
    (["run_name=caf\udce9"], "run_name: 'caf\\udce9' is invalid: must be UTF-8 text"),
    ([f"run_name={BIG_NAME}"], "is invalid: must be at most 255 bytes long (it has 10000000)"),
    (['participation={"join_ratio": 0.5, "join_ratio": 1}'], "participation: the value is refused: duplicate key "
                                                             "'join_ratio'"),
    (["model.hidden=" + DEEP], "model.hidden: the value is refused: nested more than 32 levels deep"),
])
def test_bad_set_values_are_one_line_and_leave_nothing(tmp_path, sets, fragment):
    out = tmp_path / "out"
    args = ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={out}", *TINY_SETS]
    for s in sets:
        args += ["--set", s]
    one_clear_line(fl(*args), fragment)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("suffix, text, fragment", [
    (".json", '{"rounds": 2, "rounds": 3}', "duplicate key 'rounds'"),
    (".json", '{"train": {"lr": 0.1, "lr": 0.2}}', "duplicate key 'lr'"),
    (".json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 32 levels deep"),
    (".toml", "rounds = 2\nrounds = 3\n", "cannot be parsed"),
    (".toml", "a = " + "[" * 50 + "]" * 50 + "\n", "nested more than 32 levels deep"),
])
def test_config_files_with_duplicate_keys_or_deep_nesting(tmp_path, suffix, text, fragment):
    cfg = tmp_path / f"c{suffix}"
    cfg.write_text(text)
    one_clear_line(fl("run", "--plugin", "fedavg", "--config", cfg, "--set", f"output_dir={tmp_path / 'o'}"),
                   fragment)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", ["deep", "duplicate", "fifo"])
def test_partition_file_given_to_fl_run(finished, tmp_path, content):
    part = tmp_path / "partition.json"
    if content == "deep":
        part.write_text('{"clients": ' + DEEP + "}")
    elif content == "duplicate":
        part.write_text('{"clients": [], "clients": []}')
    else:
        os.mkfifo(part)
    with deadline(60):
        res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path / 'o'}",
                 "--set", f"partition.from={part}", *TINY_SETS[2:])
    one_clear_line(res, f"partition file '{part}'")
    if content != "fifo":  # (a FIFO is not a file: "does not exist")
        assert ("nested more than 32" if content == "deep" else "duplicate key 'clients'") in res.output


@pytest.mark.parametrize("args", [["run", "--plugin", "x" * 300], ["show", "x" * 300],
                                  ["run", "--plugin", "x" * 1_000_000]])
def test_a_very_long_plugin_name_is_one_short_line(args):
    with deadline(30):
        res = fl(*args)
    one_clear_line(res, "characters; names are short). Available:")
    assert "fedavg" in res.output


def test_fl_list_lines_fit_the_width():
    res = fl("list")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(ln) for ln in lines) <= 100  # not a terminal: 100 characters
    assert any(ln.endswith("...") for ln in lines)  # long descriptions are cut, not wrapped
    assert "fedavg" in res.output


# -- fl compare: reused run directories ----------------------------------------------------------------------------
def test_compare_logs_to_tensorboard_and_refuses_a_hostile_reused_run(tmp_path):
    out = tmp_path / "cmp"
    args = ["compare", "--plugins", "fedavg", "--seeds", "0", "--out", out, "--no-progress", *TINY_SETS]
    res = fl(*args)
    assert res.exit_code == 0, res.output
    run_dir = out / "runs" / "fedavg-seed0"
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    assert f"tensorboard --logdir {out / 'runs'}" in res.output
    # a reused run's log with values of other types: they count as absent, the table is still made
    recs = records(run_dir)
    recs[0]["round_seconds"] = "slow"
    recs[0]["accuracy/weighted"] = [1]
    write_records(run_dir, recs)
    assert fl(*args).exit_code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    for damage, fragment in ((dict(final=[0.5]), "'final' is list, expected an object"),
                             (dict(final={"k": 5}), "lacks 'final.uniform'"),
                             (dict(metric={"deep": json.loads("[" * 40 + "]" * 40)}), "nested more than 32")):
        (run_dir / "summary.json").write_text(json.dumps({**summary, **damage}))
        one_clear_line(fl(*args), str(run_dir / "summary.json"))
    os.unlink(run_dir / "summary.json")
    os.symlink("/dev/zero", run_dir / "summary.json")
    with deadline(30):
        one_clear_line(fl(*args), "is a symbolic link")


@pytest.mark.parametrize("content, fragment", [("deep", "nested more than 32 levels deep"),
                                               ("duplicate", "duplicate key 'clients'")])
def test_partition_json_read_on_resume(run, content, fragment):
    (run / "partition.json").write_text('{"clients": ' + DEEP + "}" if content == "deep" else
                                        '{"clients": [], "clients": []}')
    one_clear_line(fl("run", "--resume", run, "--no-progress", "--set", "rounds=3"), fragment)


@pytest.mark.parametrize("command", ["plot", "export"])
def test_a_run_directory_name_too_long_is_one_short_line(tmp_path, command):
    name = tmp_path / ("a" * 5000)
    args = [command, name] + (["--csv", "-"] if command == "export" else ["--out", tmp_path / "c.png"])
    res = fl(*args)
    one_clear_line(res, "cannot be read (File name too long)")
    assert "... (5" in res.output and len(res.output) < 400
