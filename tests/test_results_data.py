"""Results as data: fl compare / fl reproduce write results.csv with its provenance, and every results table a
document publishes is rendered from a CSV under results/ (fl results), never typed."""
import csv
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core.cli.main import cli
from pflkit.core.results.compare import results_markdown, run_comparison
from pflkit.core.results.published import (PROVENANCE, machine_line, read_results_csv, render_document,
                                           render_table, results_csv, unmarked_result_tables)
from pflkit.core.storage.runinfo import git_commit
from pflkit.core.testing import TINY

REPO = Path(__file__).resolve().parent.parent


def results(*args):
    return CliRunner().invoke(cli, ["results", *args])


def test_compare_writes_its_table_as_data_with_the_machine_and_commit(tmp_path):
    out = tmp_path / "cmp"
    res = run_comparison(["fedavg", "local"], [0, 1], [TINY], out)
    columns, rows = read_results_csv(out / "results.csv")
    assert columns[-len(PROVENANCE):] == list(PROVENANCE)
    assert [r["algorithm"] for r in rows] == ["fedavg", "local"]
    # the CSV holds what results.md shows: its rendering is results.md's table
    assert render_table(out / "results.csv") in results_markdown(res)
    fedavg = rows[0]
    mean, std = (100 * res["results"]["fedavg"]["final_uniform"][k] for k in ("mean", "std"))
    assert fedavg["final accuracy, uniform (%)"] == f"{mean:.2f} ± {std:.2f}"
    assert fedavg["seeds"] == "0 1" and fedavg["date"][:2] == "20"
    import numpy

    machine = fedavg["machine"]
    assert f"torch {torch.__version__}" in machine and f"numpy {numpy.__version__}" in machine
    assert "device cpu, 1 torch thread" in machine
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"{capability} kernels" in machine
    assert "20 clients" not in fedavg["notes"] and "4 clients, 2 rounds" in fedavg["notes"]
    import pflkit.core

    from_checkout = Path(pflkit.core.__file__).resolve().parents[1] == REPO  # an editable install of this checkout
    if (REPO / ".git").exists():  # the runs record its commit: read from the checkout, or from the wheel built of it
        commit = git_commit()
        assert commit is not None
        if from_checkout:
            assert Path(commit["path"]) == REPO
        assert fedavg["commit"].startswith(commit["commit"][:10])
    assert {r["machine"] for r in rows} == {machine}  # provenance: the same on every row


def test_machine_line_of_a_run_info_entry():
    entry = {"cpu_model": "AMD EPYC 7B13", "cpu_count": 2, "cpu_capability": "AVX512", "torch": "2.14.1",
             "libraries": {"numpy": "2.4.6"}, "device": "cpu", "threads": 1}
    assert machine_line(entry) == ("AMD EPYC 7B13 (2 CPUs, AVX512 kernels), torch 2.14.1, numpy 2.4.6, device cpu, "
                                   "1 torch thread")
    gpu = machine_line({**entry, "device": "cuda:0", "device_name": "NVIDIA H100", "threads": 4})
    assert "device cuda:0 (NVIDIA H100), 4 torch threads" in gpu


def _doc(tmp_path, body):
    (tmp_path / "results").mkdir(exist_ok=True)
    prov = {"command": "fl compare ...", "commit": "abc1234", "date": "2026-11-27", "machine": "m", "seeds": "0",
            "notes": ""}
    (tmp_path / "results" / "t.csv").write_text(results_csv(
        ["method", "accuracy (%)", "x|y"], [{"method": "a", "accuracy (%)": "1.00 ± 0.10", "x|y": "p"},
                                            {"method": "b", "accuracy (%)": "2.00 ± 0.20", "x|y": "q"}], prov))
    doc = tmp_path / "README.md"
    doc.write_text(body)
    return doc


def test_fl_results_remakes_marked_tables_and_check_names_what_differs(tmp_path):
    doc = _doc(tmp_path, "# T\n\ntext\n<!-- results: results/t.csv -->\n| method | accuracy (%) |\n|---|---|\n"
                         "| a | 9.99 ± 0.10 |\n<!-- /results -->\nafter\n\n<!-- results: results/t.csv | x\\|y | method "
                         "-->\n<!-- /results -->\n")
    check = results("--check", "--root", str(tmp_path))
    assert check.exit_code == 1, check.output
    assert check.output.count("differs from its CSV") == 2
    done = results("--root", str(tmp_path))
    assert done.exit_code == 0, done.output
    text = doc.read_text()
    assert ("<!-- results: results/t.csv -->\n| method | accuracy (%) | x\\|y |\n|---|---|---|\n"
            "| a | 1.00 ± 0.10 | p |\n| b | 2.00 ± 0.20 | q |\n<!-- /results -->\nafter\n") in text
    assert "| x\\|y | method |\n|---|---|\n| p | a |\n| q | b |\n<!-- /results -->" in text  # chosen columns
    assert text.startswith("# T\n\ntext\n") and "commit" not in text  # provenance stays in the CSV
    again = results("--check", "--root", str(tmp_path))
    assert again.exit_code == 0 and "2 table(s) in 1 document(s) match their CSVs" in again.output
    example = "```text\n<!-- results: results/t.csv -->\n| method | ... |\n<!-- /results -->\n```\n"
    assert render_document(example, tmp_path) == (example, [], [])  # a marker in a code block is an example


def test_a_typed_mean_std_table_is_refused_by_the_check(tmp_path):
    text = "intro\n\n| method | accuracy |\n|---|---|\n| a | 1.0 ± 0.1 |\n\n```\n| a | 1 ± 2 |\n```\n"
    assert unmarked_result_tables(text) == [3]  # not the one inside a code block
    _doc(tmp_path, text)
    check = results("--check", "--root", str(tmp_path))
    assert check.exit_code == 1 and "README.md, line 3: a mean ± std table outside <!-- results" in check.output


@pytest.mark.parametrize("body, words", [
    ("<!-- results: results/absent.csv -->\n<!-- /results -->\n", "results file"),
    ("<!-- results: results/t.csv | accuracy -->\n<!-- /results -->\n",
     "has no column 'accuracy'. Did you mean 'accuracy (%)'?"),
    ("<!-- results: results/t.csv -->\n| a |\n", "is not closed by <!-- /results -->"),
    ("| a |\n<!-- /results -->\n", "without an opening"),
    ("<!-- results: ../outside.csv -->\n<!-- /results -->\n", "is outside"),
])
def test_bad_markers_are_one_line_exit_2(tmp_path, body, words):
    doc = _doc(tmp_path, body)
    before = doc.read_text()
    res = results("--root", str(tmp_path))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in res.output, res.output
    assert doc.read_text() == before


def test_a_csv_without_provenance_or_with_ragged_rows_is_refused(tmp_path):
    from pflkit.core.common.errors import ConfigError

    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="lacks the provenance column 'command'"):
        read_results_csv(path)
    path.write_text("a," + ",".join(PROVENANCE) + "\n1,2\n")
    with pytest.raises(ConfigError, match="line 2: 2 cells where the header has 7"):
        read_results_csv(path)
    with pytest.raises(ValueError):
        results_csv(["notes"], [], {})


def test_every_published_table_is_its_csv_rendered():
    """README.md, docs/*.md and the plugins' READMEs: every mean ± std table sits between results markers and
    equals the rendering of its CSV; every CSV under results/ is shown somewhere and says where it came from."""
    res = results("--check", "--root", str(REPO))
    assert res.exit_code == 0, res.output
    shown = set()
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *REPO.glob("plugins/*/README.md")]:
        text = doc.read_text()
        _, changed, marked = render_document(text, REPO, str(doc))
        assert changed == []
        shown |= set(marked)
    on_disk = {f"results/{p.name}" for p in (REPO / "results").glob("*.csv")}
    assert on_disk and on_disk == shown
    for name in on_disk:
        _, rows = read_results_csv(REPO / name)
        assert rows and all(r["commit"] and r["date"] and r["notes"] + r["machine"] for r in rows), name
