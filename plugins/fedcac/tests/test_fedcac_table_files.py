"""fedcac:table1 and fedcac:table2 (FedCAC's Tables 1 and 2 as pflkit.tables files) are registered, complete and
valid offline."""
from __future__ import annotations

import subprocess
import sys
from importlib import resources

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from pflkit.core import TABLES

ROWS = ["fedavg", "separate", "fedamp", "fedrep", "fedbn", "fedper", "fedcac", "fedcac_b170"]
PLUGINS = {"fedavg": "fedavg", "separate": "local", "fedamp": "fedamp", "fedrep": "fedrep", "fedbn": "fedbn",
           "fedper": "fedper", "fedcac": "fedcac", "fedcac_b170": "fedcac"}
TABLE1 = ["cifar10", "cifar100", "tiny"]
TABLE2 = ["c10_a01", "c10_a05", "c10_a1", "c100_a001", "c100_a01", "c100_a05", "tiny_a001", "tiny_a01", "tiny_a05"]


def _load(name: str) -> dict:
    return tomllib.loads(resources.files("pflkit_fedcac.tables").joinpath(f"{name}.toml").read_text(encoding="utf-8"))


def _check_common(t: dict, columns: list) -> None:
    assert [c["id"] for c in t["columns"]] == columns
    assert [r["id"] for r in t["rows"]] == ROWS
    assert {r["id"]: r["plugin"] for r in t["rows"]} == PLUGINS
    # the paper's shared setting (Sec. 4.1-4.2) and metric
    s = t["settings"]
    assert s["rounds"] == 500 and s["participation"]["join_ratio"] == 1.0
    assert s["split"] == {"train_size": 500, "test_size": 100}
    assert s["train"] == {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "batch_size": 100, "local_epochs": 5}
    assert (t["metric"]["model"], t["metric"]["mean"], t["metric"]["round"], t["metric"]["pflkit"]) == \
        ("personal", "uniform", "best", "best_uniform")
    for c in t["columns"]:
        assert c["set"]["partition"]["num_clients"] == 40
        cifar10 = c["set"]["dataset"]["name"] == "cifar10"
        assert c["set"]["model"]["name"] == ("resnet8" if cifar10 else "resnet10")
    # FedCAC's beta by dataset (Sec. 4.5), tau 0.5
    beta = {r["id"]: r.get("options", {}).get("aggregator", {}).get("beta") for r in t["rows"]}
    assert (beta["fedcac"], beta["fedcac_b170"]) == (100.0, 170.0)
    # every cell the paper reports is a [mean, std], exactly once between the two FedCAC rows
    cifar10_cols = [c["id"] for c in t["columns"] if c["set"]["dataset"]["name"] == "cifar10"]
    for row in ROWS:
        cells = t["numbers"][row]
        reported = [c for c in columns if isinstance(cells[c], list)]
        assert all(len(cells[c]) == 2 for c in reported)
        expected = {"fedcac": cifar10_cols,
                    "fedcac_b170": [c for c in columns if c not in cifar10_cols]}.get(row, columns)
        assert reported == expected, row
    assert any(c["setting"] == "SGD momentum" for c in t["chosen"])


def test_tables_registered_complete_and_valid():
    assert {"fedcac:table1", "fedcac:table2"} <= set(TABLES.names())
    t1, t2 = _load("table1"), _load("table2")
    _check_common(t1, TABLE1)
    _check_common(t2, TABLE2)
    assert all(c["set"]["partition"]["name"] == "pathological" and c["set"]["partition"]["classes_per_client"] == 2
               for c in t1["columns"])
    assert [c["set"]["partition"]["alpha"] for c in t2["columns"]] == [0.1, 0.5, 1.0, 0.01, 0.1, 0.5, 0.01, 0.1, 0.5]
    assert all(c["set"]["partition"]["name"] == "fixed" and c["set"]["partition"]["samples_per_client"] == 600
               for c in t2["columns"])
    # spot checks against the paper
    assert t1["numbers"]["fedcac"]["cifar10"] == [89.77, 1.14]
    assert t1["numbers"]["fedcac_b170"]["tiny"] == [90.36, 0.75]
    assert t1["numbers"]["fedavg"]["tiny"] == [17.93, 2.81]
    assert t2["numbers"]["separate"]["tiny_a05"] == [8.75, 0.30]
    assert t2["numbers"]["fedbn"]["c100_a05"] == [36.94, 0.94]
    assert t2["numbers"]["fedcac_b170"]["c100_a01"] == [57.22, 1.52]
    assert t2["numbers"]["fedcac"]["c10_a1"] == [65.39, 0.51]
    out = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "reproduce", "--check"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fedcac:table1: ok (8 rows x 3 columns, 24 cells resolved)" in out.stdout
    assert "fedcac:table2: ok (8 rows x 9 columns, 72 cells resolved)" in out.stdout
