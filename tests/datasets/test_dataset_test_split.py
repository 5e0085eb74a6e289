"""A dataset's own test set (issue 37: PCFL Table 3 trains on all of UCI adult.data and tests on adult.test) and the
PCFL authors' Adult encoding (the 8 categorical columns, 99 one-hot inputs, '?' all zeros, numeric columns
dropped). Adult files are written here in UCI's real format (headerless, comma and space; adult.test opens with
``|1x3 Cross validator`` and writes labels with a trailing '.')."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pflkit.core.common.errors import ConfigError, DataError
from pflkit.core.data.data import build_federated_data
from pflkit.core.engine.config import resolve
from pflkit.datasets.tabular import ADULT_CATEGORIES, load_adult

EDU = ["Bachelors", "HS-grad", "Masters", "Doctorate", "Some-college"]


def _row(i: int, edu: str, test: bool, work: str = "Private") -> str:
    rich = i % 3 == 0
    label = (">50K" if rich else "<=50K") + ("." if test else "")
    return ", ".join(map(str, [20 + i % 50, work, 100000 + i, edu, 9, "Never-married", "Adm-clerical",
                               "Not-in-family", "White", "Male" if i % 2 else "Female", 1000 * rich, 0, 40,
                               "United-States" if i % 4 else "?", label]))


def write_adult(root: Path, n_train: int = 60, n_test: int = 30) -> Path:
    folder = root / "adult"
    folder.mkdir(parents=True)
    works = ["Private", "State-gov", "?"]
    (folder / "adult.data").write_text("\n".join(_row(i, EDU[i % 5], False, works[i % 3]) for i in range(n_train)) + "\n")
    (folder / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(
        _row(i, EDU[i % 5], True, works[i % 3]) for i in range(n_test)) + "\n")
    return root


def test_categorical_features_are_the_authors_99_one_hot_codes(tmp_path):
    root = write_adult(tmp_path)
    bundle = load_adult(root=str(root), features="categorical", test_path="adult.test")
    assert bundle.x.shape == (90, 99) == (90, sum(len(v) for v in ADULT_CATEGORIES.values()))
    names = bundle.meta["feature_names"]
    assert names[21] == "education=Doctorate"  # the authors' code finds the PhD rows at input 21
    # '?' is all zeros in its column's block: the workclass block of a row with workclass '?' sums to 0
    work = bundle.x[:, :8].sum(1)
    assert set(work.tolist()) == {0.0, 1.0} and (work == 0).sum() == 30  # every third row has workclass '?'
    assert not any(n.startswith(("age", "capital", "hours")) for n in names)
    # labels: '>50K.' of adult.test is '>50K'; 1 = >50K
    assert bundle.class_names == ["<=50K", ">50K"] and int(bundle.y[0]) == 1 and int(bundle.y[60]) == 1
    assert bundle.test_rows.tolist() == [False] * 60 + [True] * 30


def test_default_features_keep_todays_encoding(tmp_path):
    root = write_adult(tmp_path)
    bundle = load_adult(root=str(root))  # adult.data only, numeric columns standardised, '?' its own code
    assert bundle.test_rows is None and len(bundle.y) == 60
    assert "age" in bundle.meta["feature_names"] and "workclass=?" in bundle.meta["feature_names"]


def test_an_unlisted_category_is_refused(tmp_path):
    root = write_adult(tmp_path)
    data = root / "adult" / "adult.data"
    data.write_text(data.read_text().replace("Never-married", "Space-married", 1))
    with pytest.raises(DataError, match="marital-status.*Space-married"):
        load_adult(root=str(root), features="categorical")


def _cfg(root: Path, **split):
    return resolve([{"dataset": {"name": "adult", "root": str(root), "group_values": ["Doctorate"],
                                 "features": "categorical", "test_path": "adult.test"},
                     "partition": {"name": "by_group", "num_clients": 2, "assign": "exact"},
                     "model": {"name": "mlp", "hidden": []}, "split": split}], algorithm="fedavg")


def test_split_test_dataset_tests_each_client_on_its_rows_of_the_test_file(tmp_path):
    root = write_adult(tmp_path)
    fed = build_federated_data(_cfg(root, test="dataset"))
    rows = fed.bundle.test_rows.numpy()
    phd = fed.bundle.groups.numpy() == 1
    for cid, group in ((0, ~phd), (1, phd)):
        s = fed.splits[cid]
        assert not rows[s.train].any() and rows[s.test].all()  # train from adult.data, test from adult.test
        assert sorted(np.r_[s.train, s.test]) == sorted(np.flatnonzero(group))
    assert len(fed.splits[1].train) == 12 and len(fed.splits[1].test) == 6  # every 5th row is Doctorate
    # the stratified split (the default) mixes both files' rows into each client's test split
    mixed = build_federated_data(_cfg(root))
    assert rows[mixed.splits[0].train].any()


def test_split_test_dataset_with_fraction_keeps_a_share_of_each_part(tmp_path):
    root = write_adult(tmp_path)
    fed = build_federated_data(_cfg(root, test="dataset", fraction=0.5))
    assert (len(fed.splits[0].train), len(fed.splits[0].test)) == (24, 12)
    rows = fed.bundle.test_rows.numpy()
    assert not rows[fed.splits[0].train].any() and rows[fed.splits[0].test].all()


def test_split_test_dataset_needs_a_dataset_that_marks_its_test_rows(tmp_path):
    cfg = resolve([{"split": {"test": "dataset"}, "partition": {"num_clients": 4}}], algorithm="fedavg")
    with pytest.raises(ConfigError, match="split.test: 'dataset' needs a dataset that marks its own test samples"):
        build_federated_data(cfg)
    with pytest.raises(ConfigError, match="split.test=dataset and split.train_size"):
        resolve([{"split": {"test": "dataset", "train_size": 10, "test_size": 5}}], algorithm="fedavg")


def test_a_bundle_with_a_malformed_test_mask_is_refused():
    from pflkit.core import DatasetBundle, classification
    with pytest.raises(DataError, match="test_rows must be a bool tensor"):
        DatasetBundle(x=torch.zeros(3, 2), y=torch.zeros(3, dtype=torch.long), task=classification(2),
                      input_shape=(2,), test_rows=torch.zeros(2, dtype=torch.bool))
