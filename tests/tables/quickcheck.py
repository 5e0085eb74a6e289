"""Run a selection of an installed table through ``fl reproduce --scale quick`` in-process and check what it wrote.

Shared by the quick-scale reproduction tests (tests/tables/test_*_table*.py): every selected cell has pflkit's
number, the paper's numbers in results.csv are the table file's, and every output line says that the numbers are
not the paper's setting.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from click.testing import CliRunner

from pflkit.core.cli.main import cli
from pflkit.core.results.tables import installed_table

NOT_PAPER = "not the paper's setting"
# every run of a test: one seed, one round, no checkpoint files (nothing resumes them)
FAST = ("rounds=1", "checkpoint.every=0", "checkpoint.final=false", "device=cpu")


def reproduce(table: str, out: Path, root: Path, cols: Sequence[str], rows: Sequence[str],
              sets: Sequence[str] = ()) -> Dict[Tuple[str, str], Dict[str, str]]:
    """``fl reproduce TABLE --scale quick --seeds 0`` on ``cols`` x ``rows`` with the data under ``root``; checks
    every selected cell and every line of the outputs; returns results.csv's rows by (row, column)."""
    args = ["reproduce", table, "--scale", "quick", "--seeds", "0", "--out", str(out), "--cols", ",".join(cols),
            "--rows", ",".join(rows), "--set", f"dataset.root={root}"]
    for s in (*FAST, *sets):
        args += ["--set", s]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    tagged = [ln for ln in result.output.splitlines() if ln.startswith("[quick scale")]  # a column's lines, the estimate
    assert tagged and all(NOT_PAPER in ln for ln in tagged), tagged[:3]
    with (out / "results.csv").open(newline="") as fh:
        cells = {(r["row"], r["column"]): r for r in csv.DictReader(fh)}
    assert sorted(cells) == sorted((r, c) for r in rows for c in cols)
    t = installed_table(table)
    for (row, col), cell in cells.items():
        assert NOT_PAPER in cell["scale"] and cell["scale"].startswith("quick scale"), cell["scale"]
        assert cell["runs"] == "1", (row, col, cell)
        ours = float(cell["pflkit_mean"])  # a number for every selected cell
        assert 0.0 <= ours <= 100.0, (row, col, ours)
        paper = t.numbers[row, col]  # the paper's numbers are the table file's
        assert cell["paper_mean"] == ("" if paper.mean is None else f"{paper.mean:.2f}"), (row, col)
        assert cell["paper_std"] == ("" if paper.std is None else f"{paper.std:.2f}"), (row, col)
        assert cell["paper_note"] == paper.why_missing, (row, col)
        assert cell["metric"].split("[")[0] == t.metric_of(row, next(c for c in t.columns if c.id == col))["pflkit"]
    assert_labelled((out / "results.md").read_text(), NOT_PAPER)
    return cells


def assert_labelled(md: str, label: str) -> None:
    """A results.md not of the paper's setting says so once per file and once per section: its title and every
    heading carry ``label``."""
    lines = md.splitlines()
    assert label in lines[0], lines[0]
    headings = [ln for ln in lines if ln.startswith("#")]
    assert len(headings) > 1 and all(label in ln for ln in headings), [ln for ln in headings if label not in ln]


def all_rows(table: str) -> List[str]:
    return [r.id for r in installed_table(table).rows]


def all_columns(table: str) -> List[str]:
    return [c.id for c in installed_table(table).columns]
