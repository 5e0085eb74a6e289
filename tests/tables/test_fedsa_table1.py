"""fedsa:table1 at quick scale on small files in the real formats: CIFAR-10 and CIFAR-100 pickles, Tiny-ImageNet's
folders. Every column runs with two rows (FedAvg and the FedSA row holding the paper's number), every row runs on
one column; the cells are scored as the paper scores them, by the global model."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import quickcheck  # noqa: E402
import realformats  # noqa: E402

TABLE = "fedsa:table1"
# the models' size, not the few samples, is what costs time (20 clients each copy, train and score one): the
# ResNet-18/34 run at width 4 (the same depth), Tiny-ImageNet's 64 x 64 JPEGs are read at 16 x 16
FEW = ("split.fraction=1.0", "model.width=4")
# the quick scale's min_size = 400 needs 8,000 samples, PFLlib's redraws (min_rule) thousands: these files hold hundreds
DIRICHLET = (*FEW, "partition.min_size=4", "partition.min_rule=move")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedsa_data")
    rng = np.random.default_rng(0)
    realformats.write_cifar10(root, 40, rng)          # 6 x 40: five data batches and the test batch
    realformats.write_cifar100(root, 250, 50, rng)
    realformats.write_tiny_imagenet(root, 20, 16, 4, rng)  # 20 classes: a pathological client holds 20
    return root


def _summary(out: Path, column: str, run: str) -> dict:
    return json.loads((out / column / "runs" / f"{run}-seed0" / "summary.json").read_text())


def test_every_column_with_two_rows_and_every_row_on_one_column(tmp_path, data_root):
    assert quickcheck.all_columns(TABLE) == ["pa_cifar10", "pa_cifar100", "pa_tiny", "pr_cifar10", "pr_cifar100",
                                             "pr_tiny", "pr_cifar100_r34"]
    out = tmp_path / "out"
    fedsa4 = "fedsa+aggregator.cv_t=0.2+aggregator.sim_t=0.2+aggregator.mic_categories=4+aggregator.max_clusters=4"
    pa = quickcheck.reproduce(TABLE, out, data_root, ["pa_cifar10"], ["fedavg", "fedsa_c4"], FEW)
    quickcheck.reproduce(TABLE, out, data_root, ["pa_cifar100"], ["fedavg", "fedsa_c5"], FEW)
    quickcheck.reproduce(TABLE, out, data_root, ["pa_tiny"], ["fedavg", "fedsa_c8"], (*FEW, "dataset.image_size=16"))
    quickcheck.reproduce(TABLE, out, data_root, ["pr_cifar10"], ["fedavg", "fedsa_c4"], DIRICHLET)
    r34 = quickcheck.reproduce(TABLE, out, data_root, ["pr_cifar100", "pr_cifar100_r34"], ["fedavg", "fedsa_c5"],
                               DIRICHLET)
    quickcheck.reproduce(TABLE, out, data_root, ["pr_tiny"], ["fedavg", "fedsa_c8"],
                         (*DIRICHLET, "dataset.image_size=16"))
    assert r34["fedsa_c5", "pr_cifar100_r34"]["paper_mean"] == "39.12"
    assert json.loads((out / "pr_cifar100_r34" / "runs" / "fedavg-seed0" / "config.json").read_text()
                      )["model"]["name"] == "resnet34"
    # the paper's metric: the global model's accuracy pooled over all clients, from each run's summary
    fedsa = _summary(out, "pa_cifar10", fedsa4)
    assert fedsa["aggregator"] == "fedsa" and fedsa["global"] is not None
    assert float(pa["fedsa_c4", "pa_cifar10"]["pflkit_mean"]) == pytest.approx(
        100 * fedsa["global"]["final"]["weighted"], abs=0.006)
    assert pa["fedsa_c4", "pa_cifar10"]["metric"] == "final_global_weighted"

    # every row on one column; FedAvg's and FedSA's runs of the first call are reused
    cells = quickcheck.reproduce(TABLE, out, data_root, ["pa_cifar10"], quickcheck.all_rows(TABLE), FEW)
    assert len(cells) == 12
    assert cells["fedsa_c4", "pa_cifar10"]["pflkit_mean"] == pa["fedsa_c4", "pa_cifar10"]["pflkit_mean"]
    assert cells["fedsa_c5", "pa_cifar10"]["paper_note"].startswith("the paper uses C = S = 4 on CIFAR-10")
    # Ditto and FedALA are scored by their global model (the paper's), FedBABU's two readings by their own metric
    assert cells["ditto", "pa_cifar10"]["metric"] == cells["fedala", "pa_cifar10"]["metric"] == "final_global_weighted"
    assert cells["fedbabu", "pa_cifar10"]["metric"] == cells["fedbabu_ft", "pa_cifar10"]["metric"] == "final_weighted"
    assert cells["fedbabu", "pa_cifar10"]["paper_mean"] == cells["fedbabu_ft", "pa_cifar10"]["paper_mean"] == "90.02"
    ditto = next((out / "pa_cifar10" / "runs").glob("ditto*-seed0"))
    summary = json.loads((ditto / "summary.json").read_text())
    assert float(cells["ditto", "pa_cifar10"]["pflkit_mean"]) == pytest.approx(
        100 * summary["global"]["final"]["weighted"], abs=0.006)
    md = (out / "results.md").read_text()
    assert "Rows scored unlike their columns" in md and "FedBABU (fine-tuned personal models)" in md
