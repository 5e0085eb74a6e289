"""pathological(size_sigma=...): PCFL's "K clients, S classes each, log-normal sizes" partition."""
from __future__ import annotations

import numpy as np
import pytest

from pflkit.core.engine.config import resolve
from pflkit.core.common.errors import ConfigError
from pflkit.datasets.partitioners import pathological

LABELS = np.repeat(np.arange(10), 300)  # 3,000 samples, 10 balanced classes


def test_lognormal_sizes_keep_classes_and_the_partition_exact():
    parts = pathological(LABELS, 30, np.random.default_rng(0), classes_per_client=5, size_sigma=1.0)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)) == len(LABELS)  # every sample used exactly once
    assert all(len(np.unique(LABELS[p])) == 5 for p in parts)     # S = 5 classes per client
    sizes = np.array([len(p) for p in parts])
    equal = [len(p) for p in pathological(LABELS, 30, np.random.default_rng(0), classes_per_client=5)]
    assert np.std(equal) < 2 < np.std(sizes)                        # balanced vs spread
    # log-normal: the log sizes are spread, the largest client holds several times the smallest
    assert sizes.max() > 3 * sizes.min()


def test_lognormal_sizes_are_seeded_and_default_unchanged():
    a = pathological(LABELS, 20, np.random.default_rng(3), classes_per_client=5, size_sigma=0.5)
    b = pathological(LABELS, 20, np.random.default_rng(3), classes_per_client=5, size_sigma=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # without size_sigma no extra random draw happens: the default partition is the one it always was
    c = pathological(LABELS, 20, np.random.default_rng(3), classes_per_client=5)
    d = pathological(LABELS, 20, np.random.default_rng(3), classes_per_client=5, size_sigma=None)
    assert all(np.array_equal(x, y) for x, y in zip(c, d))


def test_size_sigma_is_validated():
    with pytest.raises(ConfigError, match="partition.size_sigma"):
        resolve([{"partition": {"name": "pathological", "size_sigma": 0}}], algorithm="fedavg")
    cfg = resolve([{"partition": {"name": "pathological", "size_sigma": 1}}], algorithm="fedavg")
    assert cfg.partition.size_sigma == 1.0
