import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def registries_snapshot():
    """Undo in-process registrations made by a test."""
    from pflkit.core.api import registry as reg

    for r in reg.ALL_REGISTRIES.values():
        r._discover()  # snapshot the discovered entries too, or restoring would forget them
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items()}
    yield reg
    for k, r in reg.ALL_REGISTRIES.items():
        r._entries = before[k]


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` (setup.cfg): such a test runs only with PFLKIT_SLOW_TESTS=1 -- one rule for every file."""
    if os.environ.get("PFLKIT_SLOW_TESTS"):
        return
    skip = pytest.mark.skipif(True, reason="slow: set PFLKIT_SLOW_TESTS=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
