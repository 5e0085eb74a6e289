"""fedc2i:table1 (Digit-5) and fedc2i:table2 (Office-10), FedC2I's Tables 1 and 2 as pflkit.tables files: registered,
complete (every row, every per-domain column and Avg, every reported number), consistent with the shipped configs,
and valid offline."""
from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from pflkit.core import TABLES
from pflkit.core.testing import installed_table

ROWS = ["local", "fedavg", "fedprox", "fedrep", "fedrod", "fedproto", "fedc2i"]
COLUMNS = {"table1": ["mnist", "svhn", "usps", "synth_digits", "mnist_m", "avg"],
           "table2": ["amazon", "caltech", "dslr", "webcam", "avg"]}
CONFIGS = {"table1": "digit5.toml", "table2": "office10.toml"}


def raw(table: str) -> dict:
    return tomllib.loads(resources.files("pflkit_fedc2i.tables").joinpath(f"{table}.toml").read_text("utf-8"))


@pytest.mark.parametrize("table", ["table1", "table2"])
def test_table_registered_and_complete(table):
    assert f"fedc2i:{table}" in TABLES.names()
    t = installed_table(f"fedc2i:{table}")
    assert [r.id for r in t.rows] == ROWS
    assert [c.id for c in t.columns] == COLUMNS[table]
    # every cell is reported by the paper as mean (std)
    assert all(cell.mean is not None and cell.std is not None for cell in t.numbers.values())
    assert len(t.numbers) == len(ROWS) * len(COLUMNS[table])
    # per-domain columns score the domain's client (k-th domain = client k), Avg the uniform mean over clients
    for k, column in enumerate(t.columns[:-1]):
        assert column.clients == [k] and column.metric["pflkit"] == "final_clients"
    assert t.columns[-1].metric["pflkit"] == "final_uniform" and t.columns[-1].clients is None
    # the paper's Avg is the plain mean of its per-domain numbers (to its rounding), for every row
    for row in ROWS:
        domains = [t.numbers[row, c].mean for c in COLUMNS[table][:-1]]
        assert sum(domains) / len(domains) == pytest.approx(t.numbers[row, "avg"].mean, abs=0.02), row
    # the paper's settings: LeNet, Adam lr 1e-3, wd 0, batch 32, 2 local epochs; 20 / 40 rounds; gamma 5; mu 0.01
    s = t.settings
    assert s["model"]["name"] == "lenet" and s["rounds"] == {"table1": 20, "table2": 40}[table]
    assert s["train"] == {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.0, "batch_size": 32, "local_epochs": 2}
    rows = {r.id: r for r in t.rows}
    assert rows["fedc2i"].options == {"trainer": {"gamma": 5.0}}
    assert rows["fedprox"].options == {"trainer": {"mu": 0.01}}
    assert t.metric["model"] == "personal" and t.metric["mean"] == "uniform"


def test_spot_checked_numbers():
    t1, t2 = raw("table1")["numbers"], raw("table2")["numbers"]
    assert t1["fedc2i"]["mnist_m"] == [83.60, 0.94] and t1["fedc2i"]["avg"] == [85.50, 0.63]
    assert t1["local"]["svhn"] == [56.63, 2.66] and t1["fedrod"]["synth_digits"] == [82.07, 0.66]
    assert t2["fedc2i"]["amazon"] == [63.72, 0.77] and t2["fedprox"]["webcam"] == [86.44, 2.94]
    assert t2["local"]["avg"] == [60.32, 0.09] and t2["fedavg"]["dslr"] == [77.08, 4.77]


@pytest.mark.parametrize("table", ["table1", "table2"])
def test_shipped_config_is_the_table_setting(table):
    """configs/digit5.toml and office10.toml (fl run) hold the table's setting: one setting, two ways to run it."""
    config = tomllib.loads((Path(__file__).resolve().parents[1] / "configs" / CONFIGS[table]).read_text("utf-8"))
    settings = raw(table)["settings"]
    for section in ("dataset", "partition", "split", "model", "train"):
        for key, value in settings[section].items():
            if (section, key) == ("partition", "assign") or (section, key) == ("partition", "shuffle"):
                continue  # by_group's defaults (exact, no shuffle), spelled out in the table
            assert config[section][key] == value, (section, key)
    assert config["rounds"] == settings["rounds"]
    assert config["eval"]["final_k"] == settings["eval"]["final_k"] == 1


def test_check_validates_both_tables():
    out = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "reproduce", "--check"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fedc2i:table1: ok (7 rows x 6 columns, 42 cells resolved)" in out.stdout
    assert "fedc2i:table2: ok (7 rows x 5 columns, 35 cells resolved)" in out.stdout
