"""fedsa:table1 (FedSA's Table 1 as a pflkit.tables file) is registered, complete and valid offline."""
from __future__ import annotations

import subprocess
import sys
from importlib import resources

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from pflkit.core import TABLES

COLUMNS = ["pa_cifar10", "pa_cifar100", "pa_tiny", "pr_cifar10", "pr_cifar100", "pr_tiny", "pr_cifar100_r34"]
# the paper's C = S per dataset (Sec. 4, Appendix B): which FedSA row holds the paper's number of each column
FEDSA_ROWS = {"fedsa_c4": ["pa_cifar10", "pr_cifar10"], "fedsa_c5": ["pa_cifar100", "pr_cifar100", "pr_cifar100_r34"],
              "fedsa_c8": ["pa_tiny", "pr_tiny"]}


def _table():
    return tomllib.loads(resources.files("pflkit_fedsa.tables").joinpath("table1.toml").read_text(encoding="utf-8"))


def test_table1_registered_complete_and_valid():
    assert "fedsa:table1" in TABLES.names()
    t = _table()
    assert [c["id"] for c in t["columns"]] == COLUMNS
    assert [r["id"] for r in t["rows"]] == ["fedavg", "fedprox", "moon", "fedgen", "fedntd", "ditto", "fedbabu",
                                           "fedbabu_ft", "fedala", *FEDSA_ROWS]
    # every cell of the paper has its [mean, std]; each FedSA cell exactly once, in the row of the paper's C = S
    for row in t["rows"]:
        cells = t["numbers"][row["id"]]
        reported = [c for c in COLUMNS if isinstance(cells[c], list)]
        assert all(len(cells[c]) == 2 for c in reported)
        assert reported == FEDSA_ROWS.get(row["id"], COLUMNS), row["id"]
    for row_id, cols in FEDSA_ROWS.items():
        categories = int(row_id[len("fedsa_c"):])
        options = next(r for r in t["rows"] if r["id"] == row_id)["options"]["aggregator"]
        assert options == {"cv_t": 0.2, "sim_t": 0.2, "mic_categories": categories, "max_clusters": categories}
    # spot checks against the paper's Table 1
    n = t["numbers"]
    assert n["fedavg"]["pa_cifar10"] == [90.79, 0.08]
    assert n["fedbabu"]["pa_cifar100"] == n["fedbabu_ft"]["pa_cifar100"] == [64.86, 0.24]
    assert n["fedgen"]["pr_cifar100_r34"] == [35.00, 0.11]
    assert n["fedsa_c5"]["pa_cifar100"] == [69.72, 0.25]
    assert n["fedsa_c8"]["pr_tiny"] == [25.41, 0.37]
    assert n["fedsa_c5"]["pr_cifar100_r34"] == [39.12, 0.04]
    # the paper's setting and metric: the global model, sample-weighted, mean of the last 10 rounds
    assert t["metric"]["pflkit"] == "final_global_weighted" and t["metric"]["k"] == 10
    s = t["settings"]
    assert (s["rounds"], s["eval"]["final_k"], s["model"]["name"], s["train"]["local_epochs"]) == (1000, 10,
                                                                                                  "resnet18", 1)
    assert t["columns"][-1]["set"]["model"]["name"] == "resnet34"
    babu_ft = next(r for r in t["rows"] if r["id"] == "fedbabu_ft")
    assert babu_ft["metric"]["model"] == "personal" and babu_ft["options"]["eval"]["adapt_epochs"] == 10
    out = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "reproduce", "--check"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fedsa:table1: ok (12 rows x 7 columns, 84 cells resolved)" in out.stdout


def test_table1_cells_resolve_with_the_papers_hyperparameters():
    """Each cell's resolved config carries the paper's setting and the row's hyperparameters."""
    from pflkit.core.testing import installed_table

    table = installed_table("fedsa:table1")

    def cfg(row, col, quick=False):
        return table.cell_config(row, col, quick)

    c = cfg("fedsa_c8", "pa_tiny")
    assert (c.aggregator.mic_categories, c.aggregator.max_clusters, c.aggregator.cv_t) == (8, 8, 0.2)
    assert (c.partition.classes_per_client, c.partition.num_clients, c.model.name) == (20, 20, "resnet18")
    assert (c.train.lr, c.train.batch_size, c.participation.join_ratio, c.eval.final_k) == (0.005, 10, 1.0, 10)
    assert cfg("fedprox", "pr_cifar10").trainer.mu == 0.001
    assert cfg("ditto", "pr_cifar10").trainer.lam == 0.001
    moon = cfg("moon", "pr_cifar100_r34")
    assert (moon.trainer.tau, moon.trainer.mu, moon.model.name, moon.model.projection_dim) == (1.0, 1.0, "resnet34",
                                                                                                256)
    q = cfg("fedsa_c5", "pr_cifar100", quick=True)  # quick scale: fewer rounds, 5 % of the data, width 16
    assert (q.rounds, q.split.fraction, q.model.width, q.partition.min_size) == (5, 0.05, 16, 400)
    assert cfg("fedavg", "pa_tiny", quick=True).dataset.image_size == 32
