"""Quick-scale reproduction of FedCAC's tables (fedcac:table1, fedcac:table2) through ``fl reproduce`` on small files
in the real CIFAR-10 (python pickle batches), CIFAR-100 (python pickles) and Tiny-ImageNet (JPEG folders) formats:
every column runs with two rows, every row on one column, so each dataset format and each method runs once.

``--set`` shrinks every cell further (1 round, 4 clients, a few samples each, ResNet width 4) so each table takes
seconds; the numbers mean nothing, the test checks the plumbing: exit 0, a number in every selected cell, the
paper's numbers are the table file's, and every output line says it is not the paper's setting.
"""
from __future__ import annotations

import csv
import sys
from importlib import resources
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
from click.testing import CliRunner

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).parent))
import realformats  # noqa: E402
import quickcheck  # noqa: E402

from pflkit.core.cli.main import cli  # noqa: E402

pytest.importorskip("pflkit_fedcac")

ROWS = ["fedavg", "separate", "fedamp", "fedrep", "fedbn", "fedper", "fedcac", "fedcac_b170"]
# shared by both tables: 1 round, 4 clients of 8 train + 4 test samples, the ResNets at width 4
SHRINK = ["rounds=1", "partition.num_clients=4", "split.train_size=8", "split.test_size=4", "model.width=4",
          "checkpoint.every=0", "device=cpu"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """A few hundred images per dataset, every class of a pathological client with at least 12 samples."""
    root = tmp_path_factory.mktemp("fedcac-data")
    rng = np.random.default_rng(0)
    realformats.write_cifar10(root, 60, rng)          # 360 images, 10 classes
    realformats.write_cifar100(root, 1800, 600, rng)  # 2,400 images, 100 classes
    realformats.write_tiny_imagenet(root, 10, 12, 3, rng)  # 10 wnids x (12 train + 3 val) 64x64 JPEGs
    return root


def _paper_numbers(table: str) -> Dict[tuple, object]:
    name = table.split(":")[1]
    text = resources.files("pflkit_fedcac.tables").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    numbers = tomllib.loads(text)["numbers"]
    return {(row, col): cell for row, cells in numbers.items() for col, cell in cells.items()}


def _reproduce(table: str, out: Path, root: Path, sets: Sequence[str], rows: Sequence[str],
               cols: Sequence[str]) -> List[dict]:
    args = ["reproduce", table, "--scale", "quick", "--seeds", "0", "--out", str(out), "--rows", ",".join(rows),
            "--cols", ",".join(cols), "--set", f"dataset.root={root}"]
    for s in [*SHRINK, *sets]:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    # labelled once per file and section: quick scale (and the --set overrides), not the paper's setting; every line
    # printed with a label says the whole label
    quickcheck.assert_labelled((out / "results.md").read_text(), "not the paper's setting")
    tagged = [line for line in res.output.splitlines() if line.startswith("[quick scale")]
    assert tagged and all("quick scale" in line and "not the paper's setting" in line for line in tagged)
    with open(out / "results.csv", newline="") as fh:
        cells = list(csv.DictReader(fh))
    assert {(c["row"], c["column"]) for c in cells} == {(r, c) for r in rows for c in cols}
    paper = _paper_numbers(table)
    for c in cells:
        assert "quick scale" in c["scale"] and "not the paper's setting" in c["scale"]
        assert c["runs"] == "1" and 0.0 <= float(c["pflkit_mean"]) <= 100.0, c
        expected = paper[c["row"], c["column"]]
        if isinstance(expected, list):  # the paper's [mean, std], copied from the table file
            assert (float(c["paper_mean"]), float(c["paper_std"])) == (expected[0], expected[1]), c
            assert c["paper_note"] == ""
        else:  # the other FedCAC row carries the paper's number for this column
            assert c["paper_mean"] == "" and c["paper_note"] == expected
    return cells


def test_fedcac_table1_quick(data_root, tmp_path):
    out = tmp_path / "t1"
    cols = ["cifar10", "cifar100", "tiny"]
    cells = _reproduce("fedcac:table1", out, data_root, [], ["fedbn", "fedcac_b170"], cols)
    assert {c["column"] for c in cells} == set(cols)
    # every row on one column (fedbn and fedcac_b170 reuse the runs above)
    cells = _reproduce("fedcac:table1", out, data_root, [], ROWS, ["cifar100"])
    numbers = {c["row"]: (c["paper_mean"], c["paper_std"]) for c in cells}
    assert numbers["fedcac_b170"] == ("93.05", "0.90") and numbers["separate"] == ("88.97", "1.10")


def test_fedcac_table2_quick(data_root, tmp_path):
    out = tmp_path / "t2"
    cols = ["c10_a01", "c10_a05", "c10_a1", "c100_a001", "c100_a01", "c100_a05", "tiny_a001", "tiny_a01", "tiny_a05"]
    fixed = ["partition.samples_per_client=12"]
    _reproduce("fedcac:table2", out, data_root, fixed, ["fedper", "fedcac"], cols)
    cells = _reproduce("fedcac:table2", out, data_root, fixed, ROWS, ["tiny_a01"])
    numbers = {c["row"]: (c["paper_mean"], c["paper_std"]) for c in cells}
    assert numbers["fedcac_b170"] == ("40.19", "1.20") and numbers["fedamp"] == ("27.85", "0.71")
