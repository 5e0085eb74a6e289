"""fedcp:table2 (FedCP's Table 2 as a pflkit.tables file) is registered, complete and valid offline."""
from __future__ import annotations

import subprocess
import sys
from importlib import resources

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from pflkit.core import TABLES

COLUMNS = ["pa_mnist", "pa_cifar10", "pa_cifar100", "pr_mnist", "pr_cifar10", "pr_cifar100", "pr_tiny",
           "pr_tiny_resnet", "pr_agnews"]


def test_table2_registered_complete_and_valid():
    assert "fedcp:table2" in TABLES.names()
    t = tomllib.loads(resources.files("pflkit_fedcp.tables").joinpath("table2.toml").read_text(encoding="utf-8"))
    assert [c["id"] for c in t["columns"]] == COLUMNS
    assert t["columns"][-1]["set"]["dataset"]["name"] == "ag_news"
    # the paper's metric (pFedMe's and PFLlib's evaluate): the best round of the sample-weighted accuracy over all clients
    assert {k: t["metric"][k] for k in ("model", "clients", "mean", "round", "pflkit")} == {
        "model": "personal", "clients": "all", "mean": "weighted", "round": "best", "pflkit": "best_weighted"}
    # every cell of the paper has its [mean, std], exactly once between the two FedCP rows (lambda 5 and lambda 1)
    for row in t["rows"]:
        cells = t["numbers"][row["id"]]
        reported = [c for c in COLUMNS if isinstance(cells[c], list)]
        assert all(len(cells[c]) == 2 for c in reported)
        expected = {"fedcp": COLUMNS[:7], "fedcp_l1": COLUMNS[7:]}.get(row["id"], COLUMNS)
        assert reported == expected, row["id"]
    assert t["numbers"]["fedcp"]["pr_cifar100"] == [59.56, 0.08]
    assert t["numbers"]["fedcp_l1"]["pr_agnews"] == [96.78, 0.09]
    out = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "reproduce", "--check"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fedcp:table2: ok (13 rows x 9 columns, 117 cells resolved)" in out.stdout
