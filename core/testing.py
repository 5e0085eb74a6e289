"""Helpers for plugin tests: a tiny, fast, fully seeded run on the embedded dataset."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from .config import deep_merge, parse_sets, resolve
from .simulation import Simulation

TINY: Dict[str, Any] = {
    "rounds": 2, "device": "cpu",
    "partition": {"num_clients": 4},
    "model": {"name": "mlp", "hidden": [32]},
    "train": {"batch_size": 32, "local_epochs": 1},
    "checkpoint": {"every": 0},
}


def tiny_config(algorithm: str, overrides: Optional[Dict[str, Any]] = None, sets: tuple = ()):
    """A resolved config for ``algorithm`` sized for unit tests (4 clients, 2 rounds, small MLP)."""
    overrides = dict(overrides or {})
    base = dict(TINY)
    if overrides.get("model", {}).get("name", "mlp") != "mlp":
        base.pop("model")  # the tiny MLP's keys do not apply to another model
    layer = deep_merge(base, overrides)
    return resolve([layer, parse_sets(sets)], algorithm=algorithm)


def quick_run(algorithm: str, tmp_path: Path, overrides: Optional[Dict[str, Any]] = None, sets: tuple = (),
              **sim_kwargs) -> Dict[str, Any]:
    """Run ``algorithm`` on a tiny config in ``tmp_path/run`` and return the run summary."""
    cfg = tiny_config(algorithm, overrides, sets)
    sim = Simulation(cfg, run_dir=Path(tmp_path) / "run", tensorboard=False, **sim_kwargs)
    return sim.run()


def run_capturing_replies(sim: Simulation) -> Dict[int, Dict[int, Dict[str, Any]]]:
    """Run ``sim`` and return what its aggregator received: round -> client -> fit reply (uploads, counts)."""
    captured: Dict[int, Dict[int, Dict[str, Any]]] = {}
    original = sim.server.aggregate_fit

    def spy(rnd, replies):
        captured[rnd] = dict(replies)
        return original(rnd, replies)

    sim.server.aggregate_fit = spy
    try:
        sim.run()
    finally:
        sim.server.aggregate_fit = original
    return captured
