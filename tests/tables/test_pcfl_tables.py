"""PCFL's tables at quick scale on small files in the real formats: pcfl:table1 on CIFAR-10's pickles, pcfl:table2 on
EMNIST's digits idx files, pcfl:table3 on Adult's adult.data. Every row runs on each table's column (Table 3: its
three columns, the average and the PhD / non-PhD clients, are scored from the same runs)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import quickcheck  # noqa: E402
import realformats  # noqa: E402

WHOLE = ("split.fraction=1.0",)  # a few hundred samples: keep them all
# Tables 1 and 2 have 150 / 200 clients: a few hundred samples leave some of them without a test sample, and every
# run scores every client, so these run 30 clients (10 % of them, 3, train each round as in the paper)
FEWER_CLIENTS = (*WHOLE, "partition.num_clients=30")
# PCFL's flow as the tables give it (24 + 20 coupling layers, 4,000 steps on CIFAR-10) is the paper's cost: the test
# runs one coupling layer each, 2 steps, d' = 2 (an exact hull needs d' + 1 codes of a label on a client) and
# batches of 100 in the collaboration phase (--set beats the row's options)
SMALL_FLOW = ("aggregator.flow_epochs=2", "aggregator.flow_transforms=1", "aggregator.flow_inner_transforms=1",
              "aggregator.flow_hidden=8", "aggregator.latent_dim=2", "train.batch_size=100")


def _pcfl_config(out: Path, column: str) -> dict:
    run = next((out / column / "runs").glob("pcfl*-seed0"))
    return json.loads((run / "config.json").read_text())


def _every_row(table: str, out: Path, root: Path, column: str, sets) -> None:
    rows = quickcheck.all_rows(table)
    assert rows[-1] == "pcfl"
    quickcheck.reproduce(table, out, root, [column], rows[:-1], sets)
    cells = quickcheck.reproduce(table, out / "pcfl", root, [column], ["pcfl"], (*sets, *SMALL_FLOW))
    agg = _pcfl_config(out / "pcfl", column)["aggregator"]
    assert (agg["flow_epochs"], agg["latent_dim"]) == (2, 2)  # the command line's --set won over the row's options
    assert cells["pcfl", column]["paper_mean"]


def test_table1_cifar10(tmp_path):
    root = tmp_path / "data"
    realformats.write_cifar10(root, 200, np.random.default_rng(0))
    _every_row("pcfl:table1", tmp_path / "out", root, "acc", FEWER_CLIENTS)


def test_table2_emnist_digits(tmp_path):
    root = tmp_path / "data"
    realformats.write_emnist(root, 1600, 400, np.random.default_rng(0), split="digits")
    _every_row("pcfl:table2", tmp_path / "out", root, "acc", FEWER_CLIENTS)


def test_table3_adult(tmp_path):
    root = tmp_path / "data"
    realformats.write_adult(root, 400, np.random.default_rng(0), n_test=200)  # the table tests on adult.test
    table = "pcfl:table3"
    cols = quickcheck.all_columns(table)
    assert cols == ["average", "nonphd", "phd"]
    rows = quickcheck.all_rows(table)
    out = tmp_path / "out"
    cells = quickcheck.reproduce(table, out, root, cols, rows[:-1], WHOLE)
    # the PhD / non-PhD columns are the two clients' own accuracies from the runs the average column scores
    summary = json.loads((out / "average" / "runs" / "fedavg-seed0" / "summary.json").read_text())
    assert float(cells["fedavg", "phd"]["pflkit_mean"]) == pytest.approx(
        100 * summary["final"]["per_client"]["1"], abs=0.006)
    assert float(cells["fedavg", "average"]["pflkit_mean"]) == pytest.approx(100 * summary["final"]["weighted"],
                                                                             abs=0.006)
    # a small flow (SMALL_FLOW: latent_dim 2) keeps the PCFL row quick on these few rows
    pcfl = quickcheck.reproduce(table, out / "pcfl", root, cols, ["pcfl"], (*WHOLE, *SMALL_FLOW))
    assert {c for _, c in pcfl} == set(cols)
