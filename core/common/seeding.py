"""Deterministic seeds derived from the run seed, so results do not depend on execution order or backend."""
from __future__ import annotations

import hashlib
import random
from typing import Any, Dict

import numpy as np
import torch


def derive_seed(seed: int, *keys: Any) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``keys`` (stable across processes and platforms)."""
    text = "/".join([str(seed)] + [str(k) for k in keys])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def seed_everything(seed: int, all_devices: bool = False) -> None:
    """Seed python, numpy and torch: the CPU generator, and every CUDA device's once CUDA is initialised.

    The core seeds before every message, so this is on the hot path: ``torch.manual_seed`` also queues a seeding of
    the lazy CUDA (and other accelerators') generators, recording the caller's Python stack each time while no GPU
    is initialised (about 0.3 ms a call, most of a small round's overhead). A generator that is not initialised has
    drawn nothing, and once it is, every later call seeds it, so the per-message seeding skips the queue; numbers on
    the CPU are the same bits. ``all_devices``: ``torch.manual_seed`` itself, for the run's first seeding (a CUDA
    device initialised afterwards then starts from that seed too)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    if all_devices:
        torch.manual_seed(seed)
        return
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
