"""fl reproduce: tables published as data (pflkit.tables), checked strictly, run through fl compare, the paper's
numbers beside pflkit's."""
import csv
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.core.api import registry as reg
from pflkit.core.cli.main import cli
from pflkit.core.results.reproduce import QUICK_LABEL, kendall_tau
from pflkit.core.storage.rundata import finished_run_problem, read_records

TINY_TABLE = """
[paper]
title = "A tiny synthetic table"
venue = "pflkit's tests"
table = 1
caption = "embedded digits"

[metric]
model = "personal"
clients = "all"
mean = "uniform"
round = "last_k"
k = 1
fine_tuned = false
pflkit = "final_uniform"

[settings]
rounds = 20
device = "cpu"
dataset = { name = "digits" }
partition = { name = "iid", num_clients = 3 }
model = { name = "mlp", hidden = [16] }
train = { batch_size = 32, local_epochs = 1 }
eval = { final_k = 1 }
checkpoint = { every = 0 }

[quick]
rounds = 2

[[columns]]
id = "mean"
label = "mean over clients"

[[columns]]
id = "worst"
label = "worst client"
metric = { mean = "per_client", pflkit = "final_min" }

[[columns]]
id = "third"
label = "client 2"
metric = { mean = "per_client", pflkit = "final_clients" }
clients = 2

[[columns]]
id = "ends"
label = "clients 0 and 2"
metric = { mean = "per_client", pflkit = "final_clients" }
clients = [0, 2]

[[columns]]
id = "pooled"
label = "best pooled accuracy"
metric = { mean = "weighted", round = "best", pflkit = "best_weighted" }

[[rows]]
id = "fedavg"
label = "FedAvg"
plugin = "fedavg"
source = "defaults"

[[rows]]
id = "fedprox"
label = "FedProx"
plugin = "fedprox"
options = { trainer = { mu = 0.1 } }
source = "mu from the paper"

[numbers]
fedavg = { mean = [50.0, 100.0], worst = [40.0], third = [45.0, 1.0], ends = [47.0], pooled = [52.0] }
fedprox = { mean = [51.0, 0.001], worst = "not reported", third = [46.0], ends = "not reported", pooled = [53.0] }

[[chosen]]
setting = "partition.seed"
value = "the run seed"
why = "the paper does not say"
"""


def run(*args):
    return CliRunner().invoke(cli, ["reproduce", *args])


def one_line_error(result):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TABLE)
    return path


def test_check_passes_over_every_installed_table():
    result = run("--check")
    assert result.exit_code == 0, result.output
    # the eight tables (FedCP 2, FedCAC 1-2, FedSA 1, PCFL 1-3, FedC2I 1-2), each checked
    for line in ("fedcp:table2: ok (13 rows x 9 columns, 117 cells resolved)",
                 "fedcac:table1: ok (8 rows x 3 columns, 24 cells resolved)",
                 "fedcac:table2: ok (8 rows x 9 columns, 72 cells resolved)",
                 "fedsa:table1: ok (12 rows x 7 columns, 84 cells resolved)",
                 "fedc2i:table1: ok (7 rows x 6 columns, 42 cells resolved)",
                 "fedc2i:table2: ok (7 rows x 5 columns, 35 cells resolved)",
                 "pcfl:table1: ok (12 rows x 1 columns, 12 cells resolved)",
                 "pcfl:table2: ok (12 rows x 1 columns, 12 cells resolved)",
                 "pcfl:table3: ok (9 rows x 3 columns, 27 cells resolved)"):
        assert line in result.output
    assert len(result.output.splitlines()) == len(reg.TABLES.names())


def test_list_lists_tables_with_their_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLKIT_DATA", str(tmp_path))  # nothing installed there
    result = run("--list")
    assert result.exit_code == 0, result.output
    assert "pcfl:table1: Precision Collaboration" in result.output and "acc (ACC (%)): dataset cifar10, unchecked" \
        in result.output
    assert "pcfl:table3: Precision Collaboration for Federated Learning" in result.output
    assert f"phd (PhD): dataset adult, MISSING (absent from {tmp_path}: fl data install adult)" in result.output
    listed = CliRunner().invoke(cli, ["list", "tables"])
    assert "pcfl:table3" in listed.output and "pflkit-pcfl" in listed.output
    shown = CliRunner().invoke(cli, ["show", "pcfl:table3"])
    assert shown.exit_code == 0, shown.output
    assert "from pflkit_pcfl.tables:table3.toml; run it: fl reproduce pcfl:table3" in shown.output


def test_table_registered_in_process_is_listed_and_checked(registries_snapshot):
    reg.TABLES.register("tests:tiny", reg.parse_table_text(TINY_TABLE, "<test>"))
    result = run("--check")
    assert result.exit_code == 0, result.output
    assert "tests:tiny: ok (2 rows x 5 columns, 10 cells resolved)" in result.output
    assert "tests:tiny: A tiny synthetic table" in run("--list").output


@pytest.mark.parametrize("edit, words", [
    (("caption =", "captoin ="), "paper: unknown key 'captoin'. Did you mean 'caption'?"),
    (('plugin = "fedprox"', 'plugin = "fedprx"'), "unknown algorithm 'fedprx'. Did you mean 'fedprox'?"),
    (("mu = 0.1", "mu = -3"), "row fedprox, column mean: trainer.mu"),
    (("fedprox = { mean = [51.0, 0.001], worst = \"not reported\", ", "fedprox = { mean = [51.0, 0.001], "),
     "numbers.fedprox: 'worst' is missing"),
    (("clients = 2", "clients = -2"), "columns[2].clients: expected a client id or a list of distinct client ids"),
    (("clients = [0, 2]", "clients = [0, 0]"), "columns[3].clients: expected a client id or a list of distinct"),
    (("clients = 2", ""), "columns[2]: pflkit metric 'final_clients' needs clients = <id>"),
    (('pflkit = "final_min" }', 'pflkit = "final_min" }\nclients = 1'),
     "columns[1].clients: scoring clients by id needs metric.pflkit = 'final_clients', not 'final_min'"),
    (("fedavg = { mean = [50.0, 100.0]", "fedavg = { mean = [50.0, 1.0, 2.0]"), "numbers.fedavg.mean: expected"),
    (('pflkit = "final_min"', 'pflkit = "final_minimum"'), "Did you mean 'final_min'?"),
    (("rounds = 20", "roundz = 20"), "unknown key 'roundz'"),
    # two rows running the same method with the same options would be one fl compare entry, scored twice
    (('plugin = "fedprox"\noptions = { trainer = { mu = 0.1 } }', 'plugin = "fedavg"'),
     "rows fedavg and fedprox run the same method with the same options (fedavg)"),
    (("[[chosen]]", "[[chosen]]\nwhom = 1"), "chosen[0]: unknown key 'whom'"),
    # a paper number written as text is not a reason for a missing number; a std is never negative
    (('worst = [40.0]', 'worst = "40.0"'), "numbers.fedavg.worst: '40.0' is a number written as text"),
    (('worst = [40.0]', 'worst = "40.0 ± 1.2"'), "is a number written as text"),
    (('third = [45.0, 1.0]', 'third = [45.0, -1.0]'), "numbers.fedavg.third: std -1.0 is negative"),
    # the scored model and the pflkit key agree: global needs a *_global_* key, personal one without
    (('pflkit = "best_weighted" }', 'pflkit = "best_global_weighted" }'),
     "columns[4].metric: model = 'personal' is not scored by pflkit = 'best_global_weighted', a global model's key"),
    (('model = "personal"', 'model = "global"'),
     "metric: model = 'global' is not scored by pflkit = 'final_uniform', a personal model's key; use one of "
     "final_global_uniform"),
    # a row's own metric: checked in every column, with its own note
    (('source = "defaults"', 'source = "defaults"\nmetric = { pflkit = "final_weighted" }'),
     "rows[0].metric: 'note' is missing"),
    (('source = "defaults"', 'source = "defaults"\nmetric = { pflkit = "best_global_uniform", note = "x" }'),
     "rows[0].metric (column mean): model = 'personal' is not scored by pflkit = 'best_global_uniform'"),
    (('source = "defaults"', 'source = "defaults"\nmetric = { pflkit = "final_weighted", note = "x" }'),
     "rows[0].metric (column third): pflkit = 'final_weighted' in a column that scores clients by id"),
    (('source = "defaults"', 'source = "defaults"\nmetric = { modle = "personal", note = "x" }'),
     "rows[0].metric: unknown key 'modle'. Did you mean 'model'?"),
    # "the mean of the last k rounds" averages the evaluations of exactly those rounds
    (("eval = { final_k = 1 }", "eval = { final_k = 2 }"),
     "column mean: eval.final_k = 2: the metric is the mean of the last 1 rounds; set eval.final_k = 1"),
    (("k = 1\n", "k = 3\n"), "eval.final_k = 1: the metric is the mean of the last 3 rounds"),
    (("k = 1\n", "k = 3\n", "eval = { final_k = 1 }", "eval = { final_k = 3, every = 5 }"),
     "eval.every = 5: the metric is the mean of the last 3 rounds, but the last 3 evaluations are of rounds 10-20"),
])
def test_bad_table_file_is_one_line_exit_2(tmp_path, edit, words):
    path = tmp_path / "bad.toml"
    text = TINY_TABLE
    for before, after in zip(edit[::2], edit[1::2]):
        assert before in text
        text = text.replace(before, after, 1)
    path.write_text(text)
    line = one_line_error(run("--check", "--table-file", str(path)))
    assert words in line, line
    assert not list(tmp_path.glob("reproduce-*"))


def test_not_toml_and_bad_selection(tmp_path, tiny_file):
    path = tmp_path / "broken.toml"
    path.write_text("[paper\n")
    assert "is not valid TOML" in one_line_error(run("--check", "--table-file", str(path)))
    assert "no row 'fedavgg' in this table. Did you mean 'fedavg'?" in one_line_error(
        run("--table-file", str(tiny_file), "--rows", "fedavgg", "--out", str(tmp_path / "o")))
    assert "unknown table 'pcfl:table33'" in one_line_error(run("pcfl:table33", "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_kendall_tau():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [10, 30, 20]) == pytest.approx(1 / 3)
    assert kendall_tau([1], [2]) is None


def test_quick_reproduction_end_to_end(tmp_path, tiny_file):
    out = tmp_path / "out"
    result = run("--table-file", str(tiny_file), "--scale", "quick", "--seeds", "0,1", "--out", str(out))
    assert result.exit_code == 0, result.output
    # one comparison for the two columns (same setting, scored two ways), 2 rounds: quick scale
    assert sorted(p.name for p in (out / "mean" / "runs").iterdir()) == [
        "fedavg-seed0", "fedavg-seed1", "fedprox+trainer.mu=0.1-seed0", "fedprox+trainer.mu=0.1-seed1"]
    assert not (out / "worst").exists()
    import json
    summary = json.loads((out / "mean" / "runs" / "fedavg-seed0" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    results = json.loads((out / "mean" / "results.json").read_text())["results"]

    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["scale"] for r in rows} == {QUICK_LABEL}
    # results as data: the provenance columns (published.PROVENANCE), the quick scale said in the notes too
    assert {r["seeds"] for r in rows} == {"0 1"} and all(QUICK_LABEL in r["notes"] for r in rows)
    assert "torch " in rows[0]["machine"] and rows[0]["command"]  # this process's command line (here pytest's)
    cell = {(r["row"], r["column"]): r for r in rows}
    fedavg = cell["fedavg", "mean"]
    assert fedavg["paper_mean"] == "50.00" and fedavg["paper_std"] == "100.00"
    ours = results["fedavg"]["final_uniform"]
    assert float(fedavg["pflkit_mean"]) == pytest.approx(100 * ours["mean"], abs=0.006)
    assert float(fedavg["pflkit_std"]) == pytest.approx(100 * ours["std"], abs=0.006)
    assert float(fedavg["difference"]) == pytest.approx(float(fedavg["pflkit_mean"]) - 50.0, abs=0.011)
    assert fedavg["within_paper_spread"] == "yes"  # paper std 100: any accuracy is within it
    assert cell["fedprox", "mean"]["within_paper_spread"] == "no"  # paper std 0.001
    # the ranking's agreement is data too: the column's Kendall's tau and same-winner flag on each of its rows
    md = (out / "results.md").read_text()
    for column in ("mean", "pooled"):
        tau = {cell[r, column]["column_kendall_tau"] for r in ("fedavg", "fedprox")}
        same = {cell[r, column]["column_same_winner"] for r in ("fedavg", "fedprox")}
        assert len(tau) == 1 and len(same) == 1 and f"Kendall's tau {tau.pop()}; same winner: {same.pop()}." in md
    worst = cell["fedavg", "worst"]
    assert worst["metric"] == "final_min" and worst["paper_std"] == "" and worst["within_paper_spread"] == "n/a"
    assert float(worst["pflkit_mean"]) < float(fedavg["pflkit_mean"])  # the lowest client is below the mean
    assert cell["fedprox", "worst"]["paper_note"] == "not reported"
    # per-client columns: the clients' final values from each run's summary (final.per_client), mean over seeds
    finals = []
    for seed in (0, 1):
        run_dir = out / "mean" / "runs" / f"fedavg-seed{seed}"
        finals.append(json.loads((run_dir / "summary.json").read_text())["final"]["per_client"])
        last = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
        assert finals[-1] == last["per_client"]  # eval.final_k = 1: the last evaluation's values
    assert cell["fedavg", "third"]["metric"] == "final_clients[2]" and cell["fedavg", "ends"]["metric"] == \
        "final_clients[0 2]"
    assert float(cell["fedavg", "third"]["pflkit_mean"]) == pytest.approx(
        100 * sum(f["2"] for f in finals) / 2, abs=0.006)
    assert float(cell["fedavg", "ends"]["pflkit_mean"]) == pytest.approx(
        100 * sum((f["0"] + f["2"]) / 2 for f in finals) / 2, abs=0.006)
    assert cell["fedprox", "third"]["paper_mean"] == "46.00" and cell["fedprox", "third"]["pflkit_mean"]
    # best_weighted: each run's best evaluation of the pooled accuracy (summary.json's best_weighted), mean over seeds
    best_pooled = [json.loads((out / "mean" / "runs" / f"fedavg-seed{seed}" / "summary.json").read_text())
                   ["best_weighted"]["weighted"] for seed in (0, 1)]
    assert cell["fedavg", "pooled"]["metric"] == "best_weighted"
    assert float(cell["fedavg", "pooled"]["pflkit_mean"]) == pytest.approx(100 * sum(best_pooled) / 2, abs=0.006)

    md = (out / "results.md").read_text()
    lines = md.splitlines()  # labelled once per file and once per section, not on every line
    assert QUICK_LABEL in lines[0] and all(QUICK_LABEL in ln for ln in lines if ln.startswith("#"))
    assert sum(QUICK_LABEL in ln for ln in lines) == 1 + 1 + sum(ln.startswith("## ") for ln in lines)
    assert re.search(r"\| FedAvg \| 50\.00 ± 100\.00 \| [\d.]+ ± [\d.]+ \| -?[\d.]+ \| yes \|", md)
    assert "Kendall's tau" in md and "same winner" in md
    assert "partition.seed = the run seed: the paper does not say" in md
    for line in result.output.splitlines():
        if " column " in line and ":" in line.split(" column ")[0] + ":":
            assert QUICK_LABEL in line, line

    # rerun of a narrower selection: every run is reused (resumable through fl compare), also for a column whose
    # runs were made under another column of the same setting
    again = run("--table-file", str(tiny_file), "--scale", "quick", "--seeds", "0,1", "--out", str(out),
                "--rows", "fedavg", "--cols", "worst")
    assert again.exit_code == 0, again.output
    assert again.output.count("reused, finished earlier") == 2
    assert [(r["row"], r["column"]) for r in csv.DictReader((out / "results.csv").open())] == [("fedavg", "worst")]
    assert not (out / "worst").exists()

    # a summary whose final.per_client was edited is not reused: the reuse check re-derives it from the log
    summary_path = out / "mean" / "runs" / "fedavg-seed0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["final"]["per_client"]["2"] += 0.25
    summary_path.write_text(json.dumps(summary))
    problem = finished_run_problem(summary, read_records(summary_path.parent / "metrics.jsonl"), 2, 1)
    assert problem and "final.per_client '2'" in problem


GLOBAL_TABLE = TINY_TABLE.replace('model = "personal"', 'model = "global"').replace(
    'pflkit = "final_uniform"', 'pflkit = "final_global_uniform"').replace(
    'metric = { mean = "weighted", round = "best", pflkit = "best_weighted" }',
    'metric = { mean = "weighted", round = "best", pflkit = "best_global_weighted" }').replace(
    'pflkit = "final_min" }', 'pflkit = "final_min", model = "personal" }').replace(
    'pflkit = "final_clients" }', 'pflkit = "final_clients", model = "personal" }').replace(
    'options = { trainer = { mu = 0.1 } }',
    'options = { trainer = { mu = 0.1 } }\nmetric = { model = "personal", pflkit = "final_uniform", '
    'note = "scored by its personal model" }')


def test_row_metric_overrides_column_and_file(tmp_path):
    """Precedence row > column > file; a row's override applies in the columns whose metric it can replace."""
    from pflkit.core.results.tables import parse_table
    from pflkit.core.api.registry import parse_table_text

    bad = tmp_path / "global.toml"
    bad.write_text(GLOBAL_TABLE)  # fedprox's own metric cannot replace the final_clients columns' metric
    assert "rows[1].metric (column third): pflkit = 'final_uniform' in a column that scores clients by id" in \
        one_line_error(run("--check", "--table-file", str(bad)))
    clients_columns = TINY_TABLE[TINY_TABLE.index('[[columns]]\nid = "third"'):TINY_TABLE.index(
        '[[columns]]\nid = "pooled"')]
    text = GLOBAL_TABLE.replace(clients_columns.replace('pflkit = "final_clients" }',
                                                        'pflkit = "final_clients", model = "personal" }'), "")
    for cells in (", third = [45.0, 1.0], ends = [47.0]", ', third = [46.0], ends = "not reported"'):
        text = text.replace(cells, "")
    table = parse_table("g", parse_table_text(text, "g.toml"))
    cols = {c.id: c for c in table.columns}
    assert sorted(cols) == ["mean", "pooled", "worst"]
    assert table.metric_of("fedavg", cols["mean"])["pflkit"] == "final_global_uniform"  # the file's
    assert table.metric_of("fedavg", cols["pooled"])["pflkit"] == "best_global_weighted"  # the column's
    assert table.metric_of("fedavg", cols["worst"])["model"] == "personal"
    for col in cols.values():  # the row's, over both
        m = table.metric_of("fedprox", col)
        assert (m["model"], m["pflkit"], m["note"]) == ("personal", "final_uniform", "scored by its personal model")
    assert table.metric_of("fedprox", cols["pooled"])["round"] == "best"  # what the row does not replace stays


def test_global_keys_read_from_the_summary(tmp_path):
    """A global key reads summary.json's global section; a run whose algorithm has no global model gives the cell
    text 'no global model', not a crash."""
    import json
    from pflkit.core.results.reproduce import NO_GLOBAL_MODEL, _no_value_reason, _run_value

    with_global = tmp_path / "a"
    with_global.mkdir()
    (with_global / "summary.json").write_text(json.dumps({
        "best_weighted": {"weighted": 0.7, "round": 3},
        "global": {"final": {"uniform": 0.5, "weighted": 0.55}, "best": {"uniform": 0.6, "round": 2},
                   "best_weighted": {"weighted": 0.65, "round": 2}}}))
    run_a = {"run_dir": str(with_global)}
    assert [_run_value(run_a, k) for k in ("best_weighted", "final_global_uniform", "final_global_weighted",
                                           "best_global_uniform", "best_global_weighted")] == [
        0.7, 0.5, 0.55, 0.6, 0.65]
    without = tmp_path / "b"
    without.mkdir()
    (without / "summary.json").write_text(json.dumps({"best_weighted": {"weighted": 0.7}, "global": None}))
    run_b = {"run_dir": str(without)}
    assert _run_value(run_b, "best_global_weighted") is None
    assert _no_value_reason(run_b, "best_global_weighted") == NO_GLOBAL_MODEL == "no global model"
    (without / "summary.json").write_text(json.dumps({"best_weighted": {"weighted": 0.7}}))  # an older run
    assert _no_value_reason(run_b, "final_global_uniform") == "no global-model numbers in its summary"


def test_missing_data_named_before_any_run(tmp_path, tiny_file):
    text = TINY_TABLE.replace('dataset = { name = "digits" }',
                              f'dataset = {{ name = "adult", root = "{tmp_path / "empty"}" }}')
    path = tmp_path / "adult.toml"
    path.write_text(text.replace('partition = { name = "iid", num_clients = 3 }',
                                 'partition = { name = "iid", num_clients = 3 }\n'))
    out = tmp_path / "out"
    line = one_line_error(run("--table-file", str(path), "--scale", "quick", "--out", str(out)))
    assert "missing data, nothing run" in line
    assert f"column mean: dataset adult absent from {tmp_path / 'empty'}: fl data install adult --root " \
           f"{tmp_path / 'empty'}" in line
    assert not out.exists()


def test_missing_files_of_a_dataset_without_package_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLKIT_DATA", str(tmp_path / "empty"))
    out = tmp_path / "out"
    line = one_line_error(run("pcfl:table1", "--scale", "quick", "--seeds", "0", "--out", str(out)))
    assert "missing data, nothing run: column acc: dataset 'cifar10': 7 file(s) missing" in line
    assert "cifar-10-batches-py/data_batch_1" in line
    assert not out.exists()


def test_a_table_entry_that_fails_to_load_is_reported_not_raised():
    try:
        import importlib_metadata as metadata
    except ImportError:  # pragma: no cover
        from importlib import metadata
    tables = reg.Registry("table", "pflkit.tables-test", load_entry=reg.load_table_entry)
    tables._discovered = True
    for name, value in (("x:absent", "pflkit_pcfl.tables:absent.toml"), ("x:ok", "pflkit_pcfl.tables:table3.toml")):
        entry = reg.Entry(name, "table", value, "pflkit-x", "0")
        entry._ep = metadata.EntryPoint(name=name, value=value, group="pflkit.tables-test")
        tables._entries[name] = entry
    failures = tables.load_all()
    assert [f.name for f in failures] == ["x:absent"]
    assert "table 'x:absent' from distribution 'pflkit-x' failed to load: FileNotFoundError" in str(failures[0])
    assert tables.get("x:ok").data["paper"]["table"] == 3


def test_set_overrides_every_cell_and_labels_every_line(tmp_path, tiny_file):
    out = tmp_path / "out"
    result = run("--table-file", str(tiny_file), "--seeds", "0", "--rows", "fedavg", "--cols", "mean", "--out",
                 str(out), "--set", "rounds=1", "--set", "split.fraction=0.3")
    assert result.exit_code == 0, result.output
    import json
    summary = json.loads((out / "mean" / "runs" / "fedavg-seed0" / "summary.json").read_text())
    assert summary["rounds_completed"] == 1  # the table says 20 rounds; --set wins in every cell
    label = "paper scale with --set rounds=1 split.fraction=0.3, not the paper's setting"
    assert {r["scale"] for r in csv.DictReader((out / "results.csv").open())} == {label}
    md = (out / "results.md").read_text()
    assert "overridden by the command line's --set" in md
    assert all(label in ln for ln in md.splitlines() if ln.startswith("#"))  # every file and section says it
    bad = run("--table-file", str(tiny_file), "--out", str(tmp_path / "o2"), "--set", "train.lrr=0.1")
    assert "lrr" in one_line_error(bad)
    assert not (tmp_path / "o2").exists()


def test_sets_of_where_and_how_a_cell_runs_keep_the_papers_label():
    from pflkit.core.results.reproduce import scale_label

    assert scale_label(False, ["dataset.root=/data", "device=cpu", "clients.batched=on"]) == ""
    assert scale_label(True, ["dataset.root=/data"]) == QUICK_LABEL
    assert scale_label(False, ["dataset.root=/data", "rounds=3"]) == \
        "paper scale with --set rounds=3, not the paper's setting"


def test_a_rows_own_quick_overrides_its_options_at_quick_scale_only(tmp_path, tiny_file):
    from pflkit.core.results.tables import parse_table, read_table_file

    text = tiny_file.read_text().replace('options = { trainer = { mu = 0.1 } }',
                                         'options = { trainer = { mu = 0.1 } }\nquick = { trainer = { mu = 0.5 } }')
    path = tmp_path / "rowquick.toml"
    path.write_text(text)
    table = parse_table(*read_table_file(str(path)))
    fedprox = next(r for r in table.rows if r.id == "fedprox")
    assert fedprox.spec() == "fedprox+trainer.mu=0.1" and fedprox.spec(quick=True) == "fedprox+trainer.mu=0.5"
    out = tmp_path / "out"
    result = run("--table-file", str(path), "--scale", "quick", "--seeds", "0", "--rows", "fedprox", "--cols",
                 "mean", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert [p.name for p in (out / "mean" / "runs").iterdir()] == ["fedprox+trainer.mu=0.5-seed0"]
    bad = tmp_path / "badquick.toml"
    bad.write_text(text.replace("quick = { trainer = { mu = 0.5 } }", "quick = { trainer = { muu = 0.5 } }"))
    assert "muu" in one_line_error(run("--check", "--table-file", str(bad)))


def test_timing_from_measured_rounds_and_the_estimate_line():
    from pflkit.core.results.estimate import Estimate, Timing, estimate_line, measured_rounds, timing_from_records

    records = [{"round": 1, "round_seconds": 1.0, "eval_seconds": 0.1},
               {"round": 2, "round_seconds": 0.2, "eval_seconds": 0.1}]
    timing = timing_from_records(records, wall=2.0)  # round 1's extra second is a one-off, round 2 the rate
    assert timing.train == pytest.approx(0.2) and timing.eval == pytest.approx(0.1)
    assert timing.fixed == pytest.approx(2.0 - 2 * 0.2 - 2 * 0.1)
    assert timing.run_seconds(10, 1) == pytest.approx(1.4 + 10 * 0.2 + 10 * 0.1)
    assert timing.run_seconds(10, 5, from_round=2) == pytest.approx(8 * 0.2 + 2 * 0.1)  # rounds 5, 10 evaluated
    assert timing_from_records([]) is None and timing_from_records(records).fixed == 0.0
    assert (measured_rounds(50), measured_rounds(2), measured_rounds(1)) == (2, 1, 1)
    est = Estimate(runs=6, finished=1, measured=2)
    for seconds in (600.0, 600.0, 600.0, 600.0, 1200.0):
        est.add(seconds)
    assert estimate_line(est, "x:table", 1) == ("estimate for x:table: 6 run(s), 1 finished earlier, 5 to run: "
                                                "about 1 h 0 min with --jobs 1 (1.0 CPU-hours of run time in all, "
                                                "one core a run), measured now from 2 paused run(s) "
                                                "that continue (measuring took 0 s, set-up included)")
    # four jobs: a quarter of the run time, but never less than the longest run; the hours size a cluster's jobs
    assert ("about 20 min with --jobs 4 (1.0 CPU-hours of run time in all, one core a run; 1 h 0 min one at a "
            "time)") in estimate_line(est, "x", 4)
    assert "(1.0 GPU-hours of run time in all, one GPU a run; " in estimate_line(est, "x", 8, unit="GPU")
    assert "about 40 min with --jobs 1" in estimate_line(Estimate(runs=2, longest=2400.0, seconds=2400.0), "x", 1)
    assert estimate_line(Estimate(runs=3, finished=3), "x", 2).endswith("0 to run: nothing to run")


def test_estimate_before_any_run_and_the_measured_runs_continue(tmp_path, tiny_file):
    """The estimate line comes before the first cell runs; its measured runs are paused (2 rounds of 5) and
    resumed by the comparison, with the numbers of an uninterrupted run."""
    import json

    from pflkit.core.results.compare import run_comparison
    from pflkit.core.results.tables import parse_table, read_table_file

    path = tmp_path / "five.toml"
    path.write_text(TINY_TABLE.replace("rounds = 20", "rounds = 5"))
    out = tmp_path / "out"
    result = run("--table-file", str(path), "--seeds", "0,1", "--cols", "mean,worst", "--out", str(out))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first_run = next(i for i, ln in enumerate(lines) if ln.startswith("[1/4]"))
    at = next(i for i, ln in enumerate(lines) if ln.startswith("estimate for "))
    assert at < first_run
    assert lines[at].startswith("estimate for five, 4 cells (2 rows x 2 columns, 1 setting(s)) x 2 seed(s): 4 run(s), "
                                "0 finished earlier, 4 to run: about ")
    assert "with --jobs 1 (" in lines[at] and "CPU-hours of run time in all, one core a run), measured now from 2 paused run(s) that continue (measuring took " in lines[at]
    assert "estimating the run time: 2 round(s) of 2 run(s), one per row and setting" in result.output
    timing = json.loads((out / "mean" / "timing.json").read_text())["runs"]
    assert sorted(timing) == ["fedavg-seed0", "fedprox+trainer.mu=0.1-seed0"]
    runs = out / "mean" / "runs"
    for name in timing:  # paused after round 2 by the measurement, resumed from there by the comparison
        resumes = [json.loads(ln) for ln in (runs / name / "resumes.jsonl").read_text().splitlines()]
        assert [r["from_round"] for r in resumes] == [2]
    assert not (runs / "fedavg-seed1" / "resumes.jsonl").exists()
    # the measured-then-resumed run gives the numbers of an uninterrupted one
    name, source = read_table_file(str(path))
    table = parse_table(name, source)
    plain = run_comparison(["fedavg"], [0], [table.layer(table.columns[0])], tmp_path / "plain")
    ours = json.loads((out / "mean" / "results.json").read_text())["results"]["fedavg"]["runs"][0]
    assert ours["final_uniform"] == plain["results"]["fedavg"]["runs"][0]["final_uniform"]
    assert ours["curve"] == plain["results"]["fedavg"]["runs"][0]["curve"]

    # a finished run made in one go gives its whole wall time (set-up included) to the estimate; a resumed one not
    from pflkit.core.results.estimate import _finished_wall

    made = _finished_wall(runs / "fedavg-seed1")
    logged = sum(r["round_seconds"] + r.get("eval_seconds", 0) for r in read_records(runs / "fedavg-seed1" /
                                                                                       "metrics.jsonl"))
    assert made is not None and made >= logged - 1.0  # run_info.json's start time has whole seconds
    assert _finished_wall(runs / "fedavg-seed0") is None
    again = run("--table-file", str(path), "--seeds", "0,1,2", "--cols", "worst", "--out", str(out))
    assert again.exit_code == 0, again.output
    line = next(ln for ln in again.output.splitlines() if ln.startswith("estimate for "))
    assert "6 run(s), 4 finished earlier, 2 to run: about" in line  # seed 2 timed by the logged rounds
    assert "from the rounds already logged" in line and "estimating the run time" not in again.output
    assert again.output.count("reused, finished earlier") == 4


def test_help_names_the_keys_that_keep_the_papers_setting():
    """fl reproduce --help and the docs say the same (one constant): device keeps the paper's setting."""
    from pflkit.core.results.labels import NEUTRAL_SET_KEYS

    text = " ".join(run("--help").output.split())
    assert f"({', '.join(NEUTRAL_SET_KEYS)}) keep the paper's setting" in text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "reproducing.md").read_text()
    assert all(f"`{k}`" in docs for k in NEUTRAL_SET_KEYS)


def test_a_row_paused_before_its_first_round_is_not_measured_again(tmp_path):
    """A run paused in its set-up (PCFL's flow: hours) is resumed by the comparison; the estimate does not start
    another seed of its row beside it, which would make that set-up a second time: the row is left untimed."""
    from pflkit.core.results.estimate import estimate_comparisons
    from pflkit.core.results.tables import parse_table, read_table_file

    path = tmp_path / "five.toml"
    path.write_text(TINY_TABLE.replace("rounds = 20", "rounds = 5"))
    table = parse_table(*read_table_file(str(path)))
    folder = tmp_path / "out" / "mean"
    settings = [(folder, table.layer(table.columns[0]))]
    first = estimate_comparisons(settings, ["fedavg"], [0])        # measures seed 0: paused after its first rounds
    assert first.measured == 1 and (folder / "runs" / "fedavg-seed0" / "checkpoint.pt").is_file()
    (folder / "runs" / "fedavg-seed0" / "metrics.jsonl").unlink()  # as if paused before round 1: no rounds logged
    (folder / "timing.json").unlink()
    again = estimate_comparisons(settings, ["fedavg"], [0, 1])
    assert (again.measured, again.unknown) == (0, 2)
    assert not (folder / "runs" / "fedavg-seed1").exists()
