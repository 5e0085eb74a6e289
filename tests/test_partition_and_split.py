import numpy as np
import pytest

from pflkit.core.data.data import split_train_test
from pflkit.core.common.errors import DataError
from pflkit.datasets.partitioners import dirichlet, iid, pathological

LABELS = np.repeat(np.arange(10), 100)


def is_true_partition(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


@pytest.mark.parametrize("fn, kw", [(iid, {}), (dirichlet, {"alpha": 0.1, "min_size": 20}),
                                    (dirichlet, {"alpha": 0.01, "min_size": 40}),
                                    (pathological, {"classes_per_client": 2})])
def test_true_partition_and_determinism(fn, kw):
    a = fn(LABELS, 20, np.random.default_rng(3), **kw)
    b = fn(LABELS, 20, np.random.default_rng(3), **kw)
    c = fn(LABELS, 20, np.random.default_rng(4), **kw)
    assert len(a) == 20 and is_true_partition(a, len(LABELS))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_min_size_is_guaranteed_and_skewed():
    parts = dirichlet(LABELS, 25, np.random.default_rng(0), alpha=0.05, min_size=30)
    assert min(len(p) for p in parts) >= 30
    dominant = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5  # strong label skew at alpha 0.05
    with pytest.raises(DataError, match="at least"):
        dirichlet(LABELS, 50, np.random.default_rng(0), min_size=30)


def test_iid_sizes_and_pathological_classes():
    sizes = [len(p) for p in iid(LABELS, 7, np.random.default_rng(0))]
    assert max(sizes) - min(sizes) <= 1
    parts = pathological(LABELS, 10, np.random.default_rng(0), classes_per_client=3)
    assert all(len(np.unique(LABELS[p])) == 3 for p in parts)
    with pytest.raises(DataError):
        pathological(LABELS, 10, np.random.default_rng(0), classes_per_client=11)


def test_split_is_stratified_disjoint_and_exact():
    idx = np.arange(0, 1000, 2)  # 50 of each label
    s = split_train_test(idx, LABELS, np.random.default_rng(0), test_ratio=0.2)
    assert len(s.test) == 100 and len(s.train) == 400
    assert set(s.train).isdisjoint(s.test) and set(s.train) | set(s.test) == set(idx)
    assert np.all(np.bincount(LABELS[s.test], minlength=10) == 10)


def test_split_fixed_counts():
    s = split_train_test(np.arange(1000), LABELS, np.random.default_rng(0), train_size=500, test_size=100)
    assert (len(s.train), len(s.test)) == (500, 100)
    with pytest.raises(DataError, match="fewer than"):
        split_train_test(np.arange(100), LABELS, np.random.default_rng(0), train_size=500, test_size=100)


def test_split_fraction_keeps_a_stratified_share_and_default_draws_nothing():
    idx = np.arange(0, 1000, 2)  # 50 of each label
    s = split_train_test(idx, LABELS, np.random.default_rng(0), test_ratio=0.2, fraction=0.1)
    kept = np.concatenate([s.train, s.test])
    assert len(kept) == 50 and len(s.test) == 10 and set(kept) <= set(idx)
    assert np.all(np.bincount(LABELS[kept], minlength=10) == 5)  # every label keeps its share
    full = split_train_test(idx, LABELS, np.random.default_rng(0), test_ratio=0.2)
    same = split_train_test(idx, LABELS, np.random.default_rng(0), test_ratio=0.2, fraction=1.0)
    assert np.array_equal(full.train, same.train) and np.array_equal(full.test, same.test)


def test_split_settings_on_a_partition_that_splits_itself_are_refused(tmp_path):
    import json

    from pflkit.core.testing import assert_run_refused

    split = tmp_path / "split.json"
    split.write_text(json.dumps({"dataset": "digits", "clients": [{"train": list(range(0, 40)), "test": [40, 41]},
                                                                   {"train": list(range(50, 90)), "test": [90, 91]}]}))
    out = tmp_path / "out"
    out.mkdir()
    assert_run_refused("fedavg", [f"partition.from={split}", "split.fraction=0.5"], "split settings do not apply",
                       out)
