"""Shared settings of the PCFL tests: one torch thread, and a tiny sine-task configuration (6 clients, a small flow)."""
import copy

import pytest
import torch

torch.set_num_threads(1)

# The paper's synthetic task, shrunk: 6 generating clients of 40 samples (30 train / 10 test), a 2-step-per-phase
# flow with small couplings, 2 rounds with half of the clients.
TINY_SINE = {
    "rounds": 2, "device": "cpu", "seed": 0,
    "dataset": {"name": "pcfl_sine", "num_clients": 6, "samples_per_client": 40},
    "partition": {"name": "by_group", "num_clients": 6},
    "model": {"name": "mlp", "hidden": [8, 8]},
    "participation": {"join_ratio": 0.5},
    "train": {"batch_size": 10, "local_epochs": 1, "lr": 0.05},
    "trainer": {"clusters": 2},
    "aggregator": {"flow_epochs": 4, "setup_block": 2, "flow_hidden": 8, "flow_transforms": 2,
                   "flow_inner_transforms": 2, "flow_join_ratio": 0.5, "flow_batch_size": 20, "flow_lr": 0.01},
    "checkpoint": {"every": 1},
}


@pytest.fixture
def tiny_sine():
    """A fresh copy of TINY_SINE (tests may edit it)."""
    return copy.deepcopy(TINY_SINE)


@pytest.fixture
def registries_snapshot():
    """Undo in-process registrations made by a test."""
    from pflkit import core as reg

    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items() if r.names() is not None}
    yield reg
    for k, r in reg.ALL_REGISTRIES.items():
        r._entries = before[k]
