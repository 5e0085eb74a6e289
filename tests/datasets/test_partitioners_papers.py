"""Partitioner options the papers' protocols need (issue 37): FedCAC's authors draw each client's classes
independently (``pathological``, ``class_draw = independent``); PFLlib's Dirichlet rule for its minimum client
size (``dirichlet``, ``min_rule = pfllib``), which FedCP and FedSA partitioned with. The defaults keep today's
partitions bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from pflkit.core.common.errors import DataError
from pflkit.datasets.partitioners import dirichlet, pathological


def _labels(classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(classes), per_class)


def _class_sets(parts, labels):
    return [frozenset(np.unique(labels[p]).tolist()) for p in parts]


def test_independent_class_draws_overlap_partially_and_at_random():
    labels = _labels(100, 60)  # CIFAR-100-like: 40 clients x 2 classes
    dealt = _class_sets(pathological(labels, 40, np.random.default_rng(0)), labels)
    drawn = _class_sets(pathological(labels, 40, np.random.default_rng(0), class_draw="independent"), labels)
    assert all(len(s) == 2 for s in drawn)
    # the deal uses 80 distinct classes and no two clients share one; independent draws share some classes
    assert sum(len(a & b) > 0 for i, a in enumerate(dealt) for b in dealt[i + 1:]) == 0
    shared = sum(len(a & b) > 0 for i, a in enumerate(drawn) for b in drawn[i + 1:])
    assert shared > 0
    # CIFAR-10-like: the deal makes 5 groups of identical clients; independent draws give partial overlaps
    labels10 = _labels(10, 120)
    dealt10 = _class_sets(pathological(labels10, 40, np.random.default_rng(1)), labels10)
    drawn10 = _class_sets(pathological(labels10, 40, np.random.default_rng(1), class_draw="independent"), labels10)
    assert len(set(dealt10)) == 5
    assert any(len(a & b) == 1 for i, a in enumerate(drawn10) for b in drawn10[i + 1:])
    # every sample of a drawn class goes to its holders, disjointly
    parts = pathological(labels10, 40, np.random.default_rng(1), class_draw="independent")
    idx = np.concatenate(parts)
    assert len(idx) == len(np.unique(idx))


def test_independent_draws_are_seeded():
    labels = _labels(10, 50)
    a = pathological(labels, 12, np.random.default_rng(3), class_draw="independent")
    b = pathological(labels, 12, np.random.default_rng(3), class_draw="independent")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_the_default_deal_is_unchanged():
    labels = _labels(10, 30)
    a = pathological(labels, 8, np.random.default_rng(5))
    b = pathological(labels, 8, np.random.default_rng(5), class_draw="deal")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_pfllib_rule_meets_min_size_and_caps_full_clients():
    rng = np.random.default_rng(0)
    labels = rng.permutation(_labels(10, 700))  # MNIST-like, 7,000 samples, 20 clients
    parts = dirichlet(labels, 20, np.random.default_rng(0), alpha=0.1, min_size=40, min_rule="pfllib")
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 40 and sizes.sum() == len(labels)
    assert len(np.unique(np.concatenate(parts))) == len(labels)
    # a client stops receiving classes once it holds N / num_clients samples: no client can exceed that by more than
    # the one class that took it over the cap (at most 700 samples here)
    assert sizes.max() <= len(labels) / 20 + 700
    again = dirichlet(labels, 20, np.random.default_rng(0), alpha=0.1, min_size=40, min_rule="pfllib")
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))
    # the default rule gives another partition than PFLlib's
    moved = dirichlet(labels, 20, np.random.default_rng(0), alpha=0.1, min_size=40)
    assert not all(np.array_equal(np.sort(x), y) for x, y in zip(moved, parts))


def test_pfllib_rule_that_never_fits_is_one_line(monkeypatch):
    import pflkit.datasets.partitioners as parts
    monkeypatch.setattr(parts, "PFLLIB_MAX_DRAWS", 5)
    labels = _labels(2, 50)
    with pytest.raises(DataError, match="min_rule=pfllib: no Dir.*5 gave every one of 10 clients 10 samples"):
        dirichlet(labels, 10, np.random.default_rng(0), alpha=0.01, min_size=10, min_rule="pfllib")


def test_within_class_shards_are_fedreps_noniid():
    from pflkit.datasets.partitioners import shards
    labels = np.random.default_rng(0).permutation(_labels(10, 5000))  # CIFAR-10's 50,000 training images
    parts = shards(labels, 150, np.random.default_rng(0), shards_per_client=5, within_class=True)
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 5 * 66 and max(sizes) <= 5 * 67 and sum(sizes) == 50000  # PCFL's n_i = 333
    assert all(len(np.unique(labels[p])) <= 5 for p in parts)
    # every shard is one class: a client's count of each class is a multiple of a shard (66 or 67 images)
    for p in parts:
        for count in np.bincount(labels[p]):
            assert count == 0 or any(count == 66 * a + 67 * b for a in range(6) for b in range(6) if a + b <= 5)
    # the label-sorted cut (the default) is unchanged by the option's existence
    a = shards(labels, 150, np.random.default_rng(1), shards_per_client=5)
    b = shards(labels, 150, np.random.default_rng(1), shards_per_client=5, within_class=False)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(DataError, match="multiple of the 10 classes"):
        shards(labels, 7, np.random.default_rng(0), shards_per_client=3, within_class=True)


def test_lenet_dropout_is_fedreps_cifar_cnn_and_absent_at_zero():
    import torch
    from pflkit.models.lenet import lenet
    plain = lenet((3, 32, 32), 10)
    fedrep = lenet((3, 32, 32), 10, hidden=[120, 64], dropout=0.6)
    assert list(plain.state_dict()) == list(lenet((3, 32, 32), 10, dropout=0.0).state_dict())
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    drops = [m for m in fedrep.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(drops) == 1 and drops[0].p == 0.6
    assert (fedrep.head.in_features, fedrep.head.out_features) == (64, 10)
