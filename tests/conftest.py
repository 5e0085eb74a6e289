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
