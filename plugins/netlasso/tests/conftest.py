"""Tiny models run fastest on one thread; several intra-op threads on a shared 2-core box mostly contend."""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def registries_snapshot():
    """Undo in-process registrations made by a test (the lambda = 0 test registers its reference trainer)."""
    from pflkit import core as reg

    for r in reg.ALL_REGISTRIES.values():
        r._discover()  # snapshot the discovered entries too, or restoring would forget them
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items()}
    yield reg
    for k, r in reg.ALL_REGISTRIES.items():
        r._entries = before[k]
