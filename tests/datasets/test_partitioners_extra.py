"""by_group, dirichlet_lognormal, fixed and shards: true partitions, sizes, determinism, errors."""
from __future__ import annotations

import numpy as np
import pytest

from pflkit.core.api import registry as reg
from pflkit.core.engine.config import resolve
from pflkit.core.data.data import build_federated_data
from pflkit.core.common.errors import ConfigError, DataError
from pflkit.datasets.partitioners import by_group, dirichlet_lognormal, fixed, shards

LABELS = np.repeat(np.arange(10), 120)  # 1,200 samples, 10 balanced classes


def assert_true_partition(parts, n, complete=True):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)), "a sample is on two clients"
    assert allidx.min() >= 0 and allidx.max() < n
    if complete:
        assert len(allidx) == n


def rng(seed=0):
    return np.random.default_rng(seed)


def test_by_group_exact_merge_split():
    groups = np.repeat([7, 3, 5], [10, 20, 30])  # arbitrary group ids
    parts = by_group(np.zeros(60, int), 3, rng(), groups)
    assert_true_partition(parts, 60)
    assert [sorted(set(groups[p])) for p in parts] == [[3], [5], [7]]  # client k = k-th group, sorted
    with pytest.raises(DataError, match="3 groups but partition.num_clients = 2"):
        by_group(np.zeros(60, int), 2, rng(), groups)
    merged = by_group(np.zeros(60, int), 2, rng(), groups, assign="merge")
    assert_true_partition(merged, 60)
    assert [sorted(set(groups[p])) for p in merged] == [[3, 7], [5]]
    split = by_group(np.zeros(60, int), 6, rng(), groups, assign="split")
    assert_true_partition(split, 60)
    assert [len(p) for p in split] == [10, 15, 5, 10, 15, 5]  # clients k and k+3 share the k-th group
    assert all(len(set(groups[p])) == 1 for p in split)
    assert len(by_group(np.zeros(60, int), 6, rng(), groups, assign="auto")) == 6
    with pytest.raises(DataError, match="assign=split"):
        by_group(np.zeros(60, int), 4, rng(), groups, assign="merge")
    with pytest.raises(DataError, match="defines groups"):
        by_group(np.zeros(60, int), 3, rng(), None)
    shuffled = by_group(np.zeros(60, int), 3, rng(5), groups, shuffle=True)
    assert_true_partition(shuffled, 60)


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_lognormal(alpha):
    parts = dirichlet_lognormal(LABELS, 20, rng(1), alpha=alpha, sigma=1.0, min_size=15)
    assert_true_partition(parts, len(LABELS))
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 15 and sizes.std() > 10  # unbalanced sizes
    again = dirichlet_lognormal(LABELS, 20, rng(1), alpha=alpha, sigma=1.0, min_size=15)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    equal = dirichlet_lognormal(LABELS, 20, rng(1), alpha=alpha, sigma=0.0, min_size=1)
    assert {len(p) for p in equal} == {60}


def test_dirichlet_lognormal_skew_grows_as_alpha_shrinks():
    def classes_per_client(alpha):
        parts = dirichlet_lognormal(LABELS, 20, rng(2), alpha=alpha, sigma=0.3, min_size=10)
        return np.mean([np.mean(np.bincount(LABELS[p], minlength=10) / len(p) > 0.05) for p in parts])
    assert classes_per_client(0.05) < classes_per_client(100.0)
    with pytest.raises(DataError, match="at least 200 samples"):
        dirichlet_lognormal(LABELS[:100], 20, rng(), min_size=200)


def test_fixed_samples_per_client():
    iid = fixed(LABELS, 8, rng(3), samples_per_client=100)
    assert_true_partition(iid, len(LABELS), complete=False)
    assert {len(p) for p in iid} == {100}
    skew = fixed(LABELS, 8, rng(3), samples_per_client=100, alpha=0.1)
    assert_true_partition(skew, len(LABELS), complete=False)
    assert {len(p) for p in skew} == {100}
    dominant = [np.bincount(LABELS[p], minlength=10).max() / 100 for p in skew]
    dominant_iid = [np.bincount(LABELS[p], minlength=10).max() / 100 for p in iid]
    assert np.mean(dominant) > np.mean(dominant_iid) + 0.2
    # demand above a class's supply is redistributed: still exact sizes
    tight = fixed(LABELS, 12, rng(4), samples_per_client=100, alpha=0.01)
    assert_true_partition(tight, len(LABELS))
    with pytest.raises(DataError, match="exceeds the 1200 samples"):
        fixed(LABELS, 13, rng(), samples_per_client=100)


def test_fixed_with_split_sizes_gives_fedcac_setting():
    cfg = resolve([{"dataset": {"name": "digits"}, "partition": {"name": "fixed", "num_clients": 4,
                                                                 "samples_per_client": 120, "alpha": 0.5},
                    "split": {"train_size": 100, "test_size": 20}, "model": {"name": "mlp"}}])
    fed = build_federated_data(cfg)
    assert [(len(s.train), len(s.test)) for s in fed.splits] == [(100, 20)] * 4
    with pytest.raises(ConfigError, match="partition.alpha"):
        resolve([{"partition": {"name": "fixed", "alpha": -1.0}}])


def test_shards_fedavg():
    parts = shards(LABELS, 30, rng(5), shards_per_client=2)
    assert_true_partition(parts, len(LABELS))
    assert {len(p) for p in parts} == {40}
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 2
    again = shards(LABELS, 30, rng(5), shards_per_client=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = shards(LABELS, 30, rng(6), shards_per_client=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    with pytest.raises(DataError, match="at least 2400 samples"):
        shards(LABELS, 600, rng(), shards_per_client=4)


def test_registered_with_params():
    for name in ("by_group", "dirichlet_lognormal", "fixed", "shards"):
        assert isinstance(reg.PARTITIONERS.get(name).params, dict)
