"""The privacy boundary, tried as a careless (not a malicious) plugin would: each leak attempt below either is
refused by the core or is documented as passing (core/privacy.py says what the guard does and does not catch).
"""
import json

import pytest
import torch

from pflkit.core import LocalSGDTrainer, Simulation
from pflkit.core.client import ClientContext, ClientTrainer
from pflkit.core.comm import Communicator
from pflkit.core.backend import ExecutionBackend
from pflkit.core.server import ServerAggregator
from pflkit.core.testing import quick_run, tiny_config


class Wrapper:
    def __init__(self, t):
        self.t = t


def x_of(ctx):
    return ctx.train.x


LEAKS = {
    # name: (what the reply carries, refused?)
    "the data tensor itself": (lambda c: x_of(c), True),
    "clone()": (lambda c: x_of(c).clone(), True),
    "x + 0": (lambda c: x_of(c) + 0, True),
    "tolist()": (lambda c: x_of(c).tolist(), True),
    "numpy()": (lambda c: x_of(c).numpy(), True),
    "transposed copy": (lambda c: x_of(c).reshape(len(x_of(c)), -1).t().contiguous(), True),
    "bytes": (lambda c: x_of(c).numpy().tobytes(), True),
    "a set": (lambda c: set(x_of(c).flatten().tolist()), True),
    "wrapped in an object": (lambda c: Wrapper(x_of(c).clone()), True),
    "one row": (lambda c: x_of(c)[3].clone(), True),
    "float64 copy": (lambda c: x_of(c).double(), True),
    "flattened": (lambda c: x_of(c).flatten().clone(), True),
    "rows repeated": (lambda c: torch.cat([x_of(c)[:2], x_of(c)[:2]]), True),
    "nested in lists and dicts": (lambda c: {"a": [{"b": x_of(c)[:3].clone()}]}, True),
    "a test-split row": (lambda c: c.test.x[0].clone(), True),
    "the label vector": (lambda c: c.train.y.clone(), True),
    "the label vector as floats in a list": (lambda c: c.train.y.float().tolist(), True),
    # documented as passing: the guard catches copies, not transformations or encodings
    "lossy half-precision copy": (lambda c: x_of(c).half(), False),
    "noise added": (lambda c: x_of(c) + 1e-3, False),
    "a statistic (per-pixel mean)": (lambda c: x_of(c).mean(0), False),
    "a string rendering": (lambda c: str(x_of(c)[0].tolist()), False),
}


class LeakyTrainer(LocalSGDTrainer):
    leak = None

    def on_fit(self, payload):
        reply = super().on_fit(payload)
        if self.ctx.cid == 0:
            reply["extra"] = type(self).leak(self.ctx)
        return reply


@pytest.mark.parametrize("name", list(LEAKS))
def test_leak_attempt(tmp_path, registries_snapshot, name):
    leak, refused = LEAKS[name]
    trainer = type("Leaky", (LeakyTrainer,), {"leak": staticmethod(leak)})
    registries_snapshot.TRAINERS.register("leaky", trainer)
    result = quick_run("fedavg", tmp_path, {"trainer": {"name": "leaky"}, "rounds": 1})
    assert result["client_failures"] == (1 if refused else 0), name


@pytest.mark.parametrize("metrics, refused", [
    ({"pixels": [0.1, 0.5, 0.7]}, True),  # raw pixel values as a metric would reach metrics.jsonl
    ({"row": "x"}, True),
    ({"nested": {"a": 1.0}}, True),
    ({"ok": 0.5, "count": 3, "t": torch.tensor(1.5)}, False),
    ({"one pixel": 0.25}, False),  # a single number cannot be told apart from any other scalar
])
def test_plugin_metrics_must_be_scalars(tmp_path, registries_snapshot, metrics, refused):
    class MetricTrainer(LocalSGDTrainer):
        def on_fit(self, payload):
            reply = super().on_fit(payload)
            reply["metrics"] = metrics if self.ctx.cid == 0 or not refused else {}
            return reply

    registries_snapshot.TRAINERS.register("metric_trainer", MetricTrainer)
    result = quick_run("fedavg", tmp_path, {"trainer": {"name": "metric_trainer"}, "rounds": 1})
    assert result["client_failures"] == (1 if refused else 0)
    if not refused:
        text = (tmp_path / "run" / "metrics.jsonl").read_text()
        assert all(f"clients/{k}" in json.loads(text.splitlines()[0]) for k in metrics)


def test_model_uploads_are_never_refused_by_chance(tmp_path):
    # 5 rounds of every client's full model against fingerprints of every row: no false positive
    result = quick_run("fedavg", tmp_path, {"rounds": 5, "model": {"name": "cnn4"}})
    assert result["client_failures"] == 0


def _reachable(root, limit=20000):
    """Every object reachable from ``root`` through attributes, slots, containers and bound methods."""
    seen, stack, out = set(), [root], []
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.Tensor)):
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        if hasattr(obj, "__self__"):
            stack.append(obj.__self__)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack += list(vars(obj).values())
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                stack.append(getattr(obj, slot))
    return out


def test_server_code_has_no_path_to_clients(tmp_path):
    """What the server strategy gets (its context and the channel) leads to no client object, context, trainer,
    backend or communicator: reading ``comm.backend.trainers[cid].ctx`` is impossible by construction."""
    seen_by_server = {}

    class Spy(ServerAggregator):
        protocol = "global-model"

        def run_round(self, rnd, selected, comm):
            seen_by_server["comm"] = comm
            with pytest.raises(AttributeError):
                comm.backend  # noqa: B018
            with pytest.raises(AttributeError):
                comm.backend = None
            super().run_round(rnd, selected, comm)

    from pflkit.core import registry
    registry.AGGREGATORS.register("spy_agg", Spy, replace=True)
    try:
        sim = Simulation(tiny_config("fedavg", {"aggregator": {"name": "spy_agg"}, "rounds": 1}),
                         run_dir=tmp_path / "r", tensorboard=False)
        sim.run()
    finally:
        registry.AGGREGATORS.unregister("spy_agg")
    forbidden = (ClientContext, ClientTrainer, ExecutionBackend, Communicator)
    for obj in _reachable(sim.server) + _reachable(seen_by_server["comm"]):
        assert not isinstance(obj, forbidden), type(obj)
    assert seen_by_server["comm"].num_clients == 4 and seen_by_server["comm"].client_ids == [0, 1, 2, 3]
