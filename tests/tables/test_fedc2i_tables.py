"""fedc2i:table1 (Digit-5) and fedc2i:table2 (Office-10) at quick scale, end to end through ``fl reproduce``, on
small files in the real formats: MNIST idx, SVHN and SynthDigits .mat, USPS bz2, MNIST-M png + labels, and the
Office-Caltech-10 image folders. Every row runs on every column (the per-domain columns and Avg of one table share
one comparison), and each per-domain column scores exactly its domain's client."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.core.cli.main import cli
from pflkit.core.data.data import build_federated_data
from pflkit.core.engine.config import parse_sets, resolve
from pflkit.core.results.tables import installed_table

sys.path.insert(0, str(Path(__file__).parent))
import realformats  # noqa: E402
import quickcheck  # noqa: E402

ROWS = ["local", "fedavg", "fedprox", "fedrep", "fedrod", "fedproto", "fedc2i"]
DIGIT5 = ["mnist", "svhn", "usps", "synth_digits", "mnist_m"]
OFFICE10 = ["amazon", "caltech", "dslr", "webcam"]


def digit5_root(tmp_path: Path) -> Path:
    root = tmp_path / "digit5"
    realformats.write_digit5(root, 60, 40, np.random.default_rng(0))  # 100 samples per domain
    return root


def office10_root(tmp_path: Path) -> Path:
    root = tmp_path / "office10"
    realformats.write_office10(root, 6, np.random.default_rng(1))  # 60 images per domain
    return root


# the small files hold 100 Digit-5 samples per domain: smaller fixed sizes than the quick scale's 200 / 1,000
DIGIT5_SETS = ["split.train_size=40", "split.test_size=40", "dataset.image_size=32"]
OFFICE10_SETS = ["dataset.image_size=32"]


def cell_config(name: str, column_id: str, sets):
    """The resolved config of a column's cells at quick scale with ``--set`` (what fl reproduce runs)."""
    table = installed_table(name)
    column = next(c for c in table.columns if c.id == column_id)
    return table, resolve([table.layer(column, quick=True), parse_sets(list(sets)), {"seed": 0}],
                          algorithm="fedc2i")


@pytest.mark.parametrize("name, make_root, sets, domains", [
    ("fedc2i:table1", digit5_root, DIGIT5_SETS, DIGIT5),
    ("fedc2i:table2", office10_root, OFFICE10_SETS, OFFICE10),
])
def test_domain_columns_score_their_domain_client(tmp_path, name, make_root, sets, domains):
    root = make_root(tmp_path)
    table, cfg = cell_config(name, "avg", [f"dataset.root={root}", *sets])
    fed = build_federated_data(cfg)
    groups = fed.bundle.groups.numpy()
    assert list(fed.bundle.group_names) == domains
    for column in table.columns[:-1]:  # every per-domain column: its client holds exactly its domain
        (cid,) = column.clients
        split = fed.splits[cid]
        assert fed.bundle.group_names[cid] == column.id
        assert set(groups[np.concatenate([split.train, split.test])]) == {cid}
        assert len(split.test) > 0
    assert table.columns[-1].id == "avg" and table.columns[-1].clients is None
    # deterministic: the same clients for another run seed (partition.seed = 0)
    _, cfg1 = cell_config(name, "avg", [f"dataset.root={root}", *sets, "seed=1"])
    again = build_federated_data(cfg1)
    assert all(np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
               for a, b in zip(fed.splits, again.splits))


@pytest.mark.parametrize("name, make_root, sets, domains, paper", [
    ("fedc2i:table1", digit5_root, DIGIT5_SETS, DIGIT5, {("fedc2i", "mnist_m"): ("83.60", "0.94"),
                                                          ("local", "avg"): ("79.81", "0.60")}),
    ("fedc2i:table2", office10_root, OFFICE10_SETS, OFFICE10, {("fedc2i", "amazon"): ("63.72", "0.77"),
                                                               ("fedavg", "avg"): ("64.87", "2.49")}),
])
def test_quick_reproduction_every_row_and_column(tmp_path, name, make_root, sets, domains, paper):
    root = make_root(tmp_path)
    out = tmp_path / "out"
    set_args = [a for s in [f"dataset.root={root}", "rounds=1", "checkpoint.every=0", *sets] for a in ("--set", s)]
    result = CliRunner().invoke(cli, ["reproduce", name, "--scale", "quick", "--seeds", "0", "--out", str(out),
                                      *set_args])
    assert result.exit_code == 0, result.output
    # one comparison for all columns (the same setting scored per domain and on average): every row ran once
    runs = sorted(p.name for p in (out / domains[0] / "runs").iterdir())
    assert len(runs) == len(ROWS) and all(r.endswith("-seed0") for r in runs)
    summary = json.loads((out / domains[0] / "runs" / "fedavg-seed0" / "summary.json").read_text())
    assert summary["rounds_completed"] == 1
    rows = list(csv.DictReader((out / "results.csv").open()))
    cells = {(r["row"], r["column"]): r for r in rows}
    assert set(cells) == {(r, c) for r in ROWS for c in [*domains, "avg"]}
    for (row, column), cell in cells.items():
        assert 0.0 <= float(cell["pflkit_mean"]) <= 100.0, (row, column)
        assert cell["paper_mean"] and cell["paper_std"]  # the paper reports every cell of both tables
        assert "not the paper's setting" in cell["scale"]
    for (row, column), (mean, std) in paper.items():
        assert (cells[row, column]["paper_mean"], cells[row, column]["paper_std"]) == (mean, std)
    # the per-domain cells are the domain client's final accuracy; Avg is their uniform mean
    per_client = summary["final"]["per_client"]
    for k, domain in enumerate(domains):
        assert cells["fedavg", domain]["metric"] == f"final_clients[{k}]"
        assert float(cells["fedavg", domain]["pflkit_mean"]) == pytest.approx(100 * per_client[str(k)], abs=0.006)
    assert float(cells["fedavg", "avg"]["pflkit_mean"]) == pytest.approx(
        100 * sum(per_client[str(k)] for k in range(len(domains))) / len(domains), abs=0.006)
    quickcheck.assert_labelled((out / "results.md").read_text(), "not the paper's setting")


# Office-Caltech-10's images per class (back_pack, bike, ..., projector) in each domain: 958 / 1123 / 157 / 295
OFFICE10_COUNTS = {"amazon": [92, 82, 94, 99, 100, 100, 99, 100, 94, 98],
                   "caltech": [151, 110, 100, 139, 85, 128, 133, 106, 87, 94],
                   "dslr": [12, 21, 12, 13, 10, 24, 22, 12, 8, 23],
                   "webcam": [29, 21, 31, 27, 27, 30, 43, 30, 27, 30]}


def test_office10_split_gives_table6_training_sizes(tmp_path):
    """On folders with the real release's class counts, table 2's paper-scale split trains on Table 6's
    200 / 200 / 125 / 197 samples per client (126 for DSLR: 80 % of its 157 images, rounded)."""
    root = tmp_path / "office_caltech_10"
    pixel = np.zeros((4, 4, 3), dtype=np.uint8)
    for domain, counts in OFFICE10_COUNTS.items():
        assert len(counts) == len(realformats.OFFICE10_CLASSES)
        for name, n in zip(realformats.OFFICE10_CLASSES, counts):
            for i in range(n):
                realformats.write_png(root / domain / name / f"frame_{i:04d}.png", pixel + i % 7)
    table = installed_table("fedc2i:table2")
    cfg = resolve([table.layer(table.columns[-1]), {"dataset": {"root": str(root), "image_size": 4}, "seed": 0}],
                  algorithm="fedc2i")
    fed = build_federated_data(cfg)
    assert [len(s.train) for s in fed.splits] == [200, 200, 126, 197]
    assert [len(s.test) for s in fed.splits] == [50, 50, 31, 49]
    labels = fed.bundle.y.numpy()
    for split in fed.splits[:2]:  # Amazon and Caltech: 20 training images of every class
        assert np.bincount(labels[split.train], minlength=10).tolist() == [20] * 10
