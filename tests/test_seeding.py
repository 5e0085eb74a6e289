"""Per-message seeding (issue 40): the CPU generator, python and numpy are seeded exactly as ``torch.manual_seed``
did, without queueing a lazy CUDA seeding per call while no GPU is initialised (it recorded the caller's stack each
time: most of a small round's overhead); the run's first seeding still seeds every device."""
from __future__ import annotations

import random

import numpy as np
import torch

from pflkit.core.common import seeding


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist()


def test_seed_everything_draws_what_torch_manual_seed_drew():
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = _draws()
    seeding.seed_everything(5)
    assert _draws() == before


def test_per_message_seeding_queues_no_lazy_device_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(("all", seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("cuda", seed)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seeding.seed_everything(7)
    assert calls == []  # no GPU initialised: nothing queued for it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    seeding.seed_everything(8)
    assert calls == [("cuda", 8)]  # an initialised GPU is seeded at every call
    seeding.seed_everything(9, all_devices=True)
    assert calls[-1] == ("all", 9)  # the run's first seeding: every device, as torch.manual_seed does
