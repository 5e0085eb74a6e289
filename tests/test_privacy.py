"""The privacy boundary, tried as a careless (not a malicious) plugin would: each leak attempt below either is
refused by the core or is documented as passing (core/engine/privacy.py says what the guard does and does not catch).
"""
import functools
import gc
import json
import sys
import types

import pytest
import torch

from pflkit.core import LocalSGDTrainer, Simulation
from pflkit.core.api.client import ClientContext, ClientTrainer
from pflkit.core.engine.comm import Communicator, ServerChannel
from pflkit.core.engine.backend import ExecutionBackend
from pflkit.core.api.protocol import BitMask
from pflkit.core.api.server import ServerAggregator
from pflkit.core.testing import quick_run, tiny_config


class Wrapper:
    def __init__(self, t):
        self.t = t


class Note(str):
    """A string that carries more than its text."""


def x_of(ctx):
    return ctx.train.x


def row_len(ctx):
    return x_of(ctx)[0].numel()


def row_at_offset(c):
    return torch.cat([torch.zeros(3), x_of(c)[5].flatten(), torch.zeros(2)])


def rows_as_columns_3d(c):  # (row length, 2, 3): six rows running along dim 0
    return x_of(c)[:6].reshape(6, -1).t().reshape(row_len(c), 2, 3).contiguous()


def rows_as_columns_taller(c):  # one extra value under each column
    return torch.cat([x_of(c)[:5].reshape(5, -1).t(), torch.zeros(1, 5)])


def bitmask_sharing_storage(c):
    buffer = x_of(c).reshape(-1).view(torch.uint8)[:16]  # the data's own bytes
    mask = BitMask(torch.zeros(128, dtype=torch.bool))  # 16 bytes of bits, well formed
    mask.packed = buffer
    return mask


def bitmask_with_float_buffer(c):
    mask = BitMask(torch.zeros(8 * row_len(c), dtype=torch.bool))
    mask.packed = x_of(c)[2].flatten().clone()
    return mask


def tensor_with_attribute(c):
    t = torch.zeros(2)
    t.note = x_of(c)[4].flatten().tolist()
    return t


def string_with_attribute(c):
    note = Note("see attached")
    note.rows = x_of(c)[6].clone()
    return note


def memory_view_at_offset(c):  # the data's memory itself, one value in: no full row, not the storage's start
    return torch.from_numpy(x_of(c).reshape(-1).numpy()[1:17])


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
    # issue 21's catalogue: forms the guard used to pass
    "a row at an offset in a flat tensor": (row_at_offset, True),
    "a list of 0-d tensors": (lambda c: list(x_of(c)[2].flatten().clone()), True),
    "rows as columns of a 3-D tensor": (rows_as_columns_3d, True),
    "a list with one trailing string": (lambda c: x_of(c)[1].flatten().tolist() + ["end"], True),
    "a packed bit buffer sharing the data's storage": (bitmask_sharing_storage, True),
    # found with them
    "rows as columns of a taller matrix": (rows_as_columns_taller, True),
    "a row split by a string in a list": (lambda c: [x_of(c)[3].flatten()[:5].clone(), "|", x_of(c)[3].flatten()[5:].clone()], True),
    "a BitMask whose buffer is a float row": (bitmask_with_float_buffer, True),
    "a tensor carrying rows in a Python attribute": (tensor_with_attribute, True),
    "a string subclass carrying a row in an attribute": (string_with_attribute, True),
    "a tensor over the data's memory at an offset": (memory_view_at_offset, True),
    "a sparse copy of a row": (lambda c: x_of(c)[0].flatten().clone().to_sparse(), True),
    "rows as the real parts of a complex tensor": (
        lambda c: torch.complex(x_of(c)[:2].reshape(2, -1).clone(), torch.zeros(2, row_len(c))), True),
    # documented as passing: the guard catches copies, not transformations or encodings
    "lossy half-precision copy": (lambda c: x_of(c).half(), False),
    "noise added": (lambda c: x_of(c) + 1e-3, False),
    "a statistic (per-pixel mean)": (lambda c: x_of(c).mean(0), False),
    "a string rendering": (lambda c: str(x_of(c)[0].tolist()), False),
    "a row with its values reversed": (lambda c: x_of(c)[0].flatten().flip(0), False),
    "a row split over two fields": (lambda c: {"a": x_of(c)[0].flatten()[:5].clone(), "b": x_of(c)[0].flatten()[5:].clone()}, False),
    "the label vector inside a longer tensor": (lambda c: torch.cat([c.train.y.float(), torch.zeros(1)]), False),
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


METRICS = {
    # name: (reply["metrics"] of client 0, refused?)
    "raw pixel values as a metric": (lambda c: {"pixels": [0.1, 0.5, 0.7]}, True),
    "a string value": (lambda c: {"row": "x"}, True),
    "a nested dict": (lambda c: {"nested": {"a": 1.0}}, True),
    "raw bytes in a metric name": (lambda c: {x_of(c)[0].numpy().tobytes()[:48].decode("latin-1"): 0.5}, True),
    "a row rendered as a metric name": (lambda c: {str(x_of(c)[0].flatten().tolist()): 0.5}, True),
    "a name with a space": (lambda c: {"one pixel": 0.25}, True),
    "a name of 65 characters": (lambda c: {"m" * 65: 1.0}, True),
    "a name starting with '/'": (lambda c: {"/etc": 1.0}, True),
    "an integer name": (lambda c: {3: 1.0}, True),
    "plain names and scalars": (lambda c: {"ok": 0.5, "count": 3, "t": torch.tensor(1.5), "a/b.c-d_e": 1.0}, False),
    "a name of 64 characters": (lambda c: {"m" * 64: 1.0}, False),
    "one pixel as a number": (lambda c: {"one_pixel": 0.25}, False),  # one number is like any other scalar
}


@pytest.mark.parametrize("name", list(METRICS))
def test_plugin_metrics_are_named_scalars(tmp_path, registries_snapshot, name):
    metrics, refused = METRICS[name]
    sent = {}

    class MetricTrainer(LocalSGDTrainer):
        def on_fit(self, payload):
            reply = super().on_fit(payload)
            reply["metrics"] = metrics(self.ctx) if self.ctx.cid == 0 or not refused else {}
            sent.update(reply["metrics"])
            return reply

    registries_snapshot.TRAINERS.register("metric_trainer", MetricTrainer)
    result = quick_run("fedavg", tmp_path, {"trainer": {"name": "metric_trainer"}, "rounds": 1})
    assert result["client_failures"] == (1 if refused else 0), name
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    logged = {k[len("clients/"):] for k in record if k.startswith("clients/")}
    if refused:  # nothing of a refused reply reaches the logs, and its failure line does not quote the name
        assert not logged
        log_text = (tmp_path / "run" / "run.log").read_text(encoding="utf-8", errors="replace")
        assert "rejected" in log_text
        assert all(str(k) not in log_text for k in sent if len(str(k)) > 20)
    else:
        assert logged == set(sent)


def test_model_uploads_are_never_refused_by_chance(tmp_path):
    # 5 rounds of every client's full model against fingerprints of every row: no false positive
    result = quick_run("fedavg", tmp_path, {"rounds": 5, "model": {"name": "cnn4"}})
    assert result["client_failures"] == 0


def _reachable(*roots):
    """Every object reachable from ``roots`` through ``gc.get_referents`` (attributes, slots, containers, closures,
    cells, defaults, bound methods' ``__self__``, classes and their dicts), plus ``__closure__``, ``__self__``,
    ``__wrapped__`` and ``__func__`` -- except modules and module globals, which any server code can import anyway
    (README, Privacy boundary)."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    seen, stack, out = set(), list(roots), []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, types.ModuleType) or id(obj) in module_dicts:
            continue
        seen.add(id(obj))
        out.append(obj)
        stack += gc.get_referents(obj)
        for name in ("__closure__", "__self__", "__wrapped__", "__func__"):
            try:
                stack.append(getattr(obj, name, None))
            except Exception:  # noqa: BLE001 -- a property that raises on a class is no path
                pass
    return out


FORBIDDEN = (ClientContext, ClientTrainer, ExecutionBackend, Communicator)


def test_reachability_walk_sees_through_closures():
    """The walk is not vacuous: a channel built as a closure over the communicator (as it was) is caught, also
    behind a decorator that keeps the function only as ``__wrapped__``."""
    comm = object.__new__(Communicator)

    def send(messages):
        return comm.send(messages)

    @functools.wraps(send)
    def decorated(*args):
        return None

    assert any(isinstance(o, Communicator) for o in _reachable(types.SimpleNamespace(send=send)))
    assert any(isinstance(o, Communicator) for o in _reachable(decorated))


def test_server_code_has_no_path_to_clients(tmp_path):
    """What the server strategy gets (its context and the channel) leads to no client object, context, trainer,
    backend or communicator: not through attributes, closures, bound methods or any referent."""
    seen_by_server = {}

    class Spy(ServerAggregator):
        protocol = "global-model"

        def run_round(self, rnd, selected, comm):
            seen_by_server["comm"] = comm
            with pytest.raises(AttributeError):
                comm.backend  # noqa: B018
            with pytest.raises(AttributeError):
                comm.backend = None
            assert not hasattr(comm.send, "__closure__") or not comm.send.__closure__
            super().run_round(rnd, selected, comm)

    from pflkit.core.api import registry
    registry.AGGREGATORS.register("spy_agg", Spy, replace=True)
    try:
        sim = Simulation(tiny_config("fedavg", {"aggregator": {"name": "spy_agg"}, "rounds": 1}),
                         run_dir=tmp_path / "r", tensorboard=True)
        sim.run()
    finally:
        registry.AGGREGATORS.unregister("spy_agg")
    channel = seen_by_server["comm"]
    assert isinstance(channel, ServerChannel)
    reached = _reachable(channel, channel.send, sim.server, sim.server_ctx)
    assert len(reached) > 1000  # the walk went through the logger, the task, the model factory, classes...
    for obj in reached:
        assert not isinstance(obj, FORBIDDEN), type(obj)
    assert channel.num_clients == 4 and channel.client_ids == [0, 1, 2, 3] and channel.round == 1


def test_channel_of_a_finished_run_says_so(tmp_path):
    sim = Simulation(tiny_config("fedavg", {"rounds": 1}), run_dir=tmp_path / "r", tensorboard=False)
    channel = sim.channel
    sim.run()
    del sim
    gc.collect()
    with pytest.raises(RuntimeError, match="ended"):
        channel.send({})


def test_the_may_hold_a_row_shortcut_is_sound():
    """A tensor with fewer values from the client's rows than a row has is not scanned; one with enough is, in
    any layout, and a row among them is still found."""
    from pflkit.core.engine.privacy import PrivacyGuard, _ClientRows, _RollingHash

    x = torch.tensor([[0., 1., 2., 3., 4., 5.], [5., 4., 3., 2., 1., 0.]], dtype=torch.float32)
    rows = _ClientRows([x], [], _RollingHash())
    assert rows.values is not None and rows.values.tolist() == [0., 1., 2., 3., 4., 5.]
    trained = torch.randn(1000) * 0.1  # weights are not exact pixel values
    assert not rows.may_hold_a_row(trained)
    trained[:5] = torch.tensor([0., 1., 2., 3., 4.])  # five of them: fewer than a row (6)
    assert not rows.may_hold_a_row(trained)
    trained[100] = 5.0
    assert rows.may_hold_a_row(trained)  # enough values: scanned (they do not form a row, nothing is refused)
    guard = PrivacyGuard()
    guard.register(0, [x], [])
    assert guard.violation(0, {"w": trained}) is None
    column = torch.randn(6, 3)
    column[:, 1] = x[1]  # a row as a column, among values that are not the data's
    assert "input row" in guard.violation(0, {"w": column})


def test_one_count_over_a_whole_reply_is_a_sound_shortcut():
    """A reply whose tensors together hold fewer row values than a row has is settled by one count; when they hold
    enough together, each tensor is counted (and scanned) as before, and a row split over no tensor is not
    invented, while a row inside one tensor among several is found."""
    from pflkit.core.engine.privacy import PrivacyGuard, _ClientRows, _RollingHash

    x = torch.tensor([[0., 1., 2., 3., 4., 5.], [5., 4., 3., 2., 1., 0.]], dtype=torch.float32)
    rows = _ClientRows([x], [], _RollingHash())
    a, b = torch.randn(50) * 0.1, torch.randn(4, 10, dtype=torch.float64) * 0.1
    a[:3], b[0, :2] = torch.tensor([0., 1., 2.]), torch.tensor([3., 4.], dtype=torch.float64)
    assert rows.none_may_hold_a_row([a, b])  # 5 values in all: fewer than a row (mixed dtypes)
    b[1, 0] = 5.0
    assert not rows.none_may_hold_a_row([a, b])  # 6 in all: each tensor is counted on its own
    guard = PrivacyGuard()
    guard.register(0, [x], [])
    assert guard.violation(0, {"a": a, "b": b, "n": [1, 2]}) is None  # 6 values, no row among them
    c = torch.randn(20) * 0.1
    c[7:13] = x[0]
    assert "input row" in guard.violation(0, {"a": a, "c": c})
    assert "input row" in guard.violation(0, {"w": torch.randn(30), "rows": [0, 1, 2, 3, 4, 5]})


def test_the_bit_pattern_screen_never_undercounts():
    """The cheap screen over float32/float64 bit patterns is an upper bound of the exact count of row values in any
    dtype (-0.0 counted as 0.0, a float64 row value float32 cannot hold matched by no float32 value)."""
    from pflkit.core.engine.privacy import _ClientRows, _RollingHash, _widen

    x = torch.tensor([[0., 0.1, 2., 3., 4., 5.], [5., 4., 3., 2., 1., -7.25]], dtype=torch.float64)
    rows = _ClientRows([x], [], _RollingHash())
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
        for _ in range(20):
            t = (torch.randn(300, generator=g) * 3).to(dtype)
            picks = torch.randint(0, 12, (40,), generator=g)
            t[torch.randint(0, 300, (40,), generator=g)] = x.reshape(-1)[picks].to(dtype)
            t[:2] = torch.tensor([-0.0, 0.1]).to(dtype)  # -0.0 is the row value 0.0; float32's 0.1 is not 0.1
            exact = rows._row_values(_widen(t))
            assert rows._screened([t])[0] >= exact, dtype
    assert rows._screened([torch.tensor([0.1] * 10, dtype=torch.float32)])[0] == 0  # nothing float32 holds equals 0.1
    assert rows._screened([torch.tensor([0.1] * 10, dtype=torch.float64)])[0] == 10
    assert rows._screened([torch.tensor([-0.0, -7.25, 5.0])]) == (3, 1)


def test_row_hashes_of_one_hot_rows_do_not_collide():
    """One-hot rows hold only 0.0 and 1.0, whose float64 bit patterns end in 52 zero bits: a hash that multiplies
    the raw patterns keeps 12 bits of each row (Adult's one-hot rows fell into a few thousand buckets, an all-zero
    window of a gradient matched a bucket, and each reply was compared against thousands of rows: minutes per PCFL
    flow step). Mixed bit patterns give every distinct row its own hash and no zero window a candidate."""
    from pflkit.core.engine.privacy import PrivacyGuard, _ClientRows, _RollingHash

    g = torch.Generator().manual_seed(0)
    x = torch.zeros(3000, 100)
    for r in range(len(x)):
        x[r, torch.randperm(100, generator=g)[:8]] = 1.0
    hasher = _RollingHash()
    rows = _ClientRows([x], [], hasher)
    distinct = len(torch.unique(x, dim=0))
    assert len(rows.known) == distinct  # one hash per distinct row
    grad = torch.zeros(20000)
    grad[::97] = torch.randn(len(grad[::97]), generator=g)
    grad[5::311] = 1.0
    found = sum(len(offsets) for _, offsets, _ in hasher.candidates(grad, 100, rows.filter))
    assert found < 20000 // 32  # the filter passes about 1 window in 64, not every zero window
    guard = PrivacyGuard()
    guard.register(0, [x], [])
    assert guard.violation(0, {"g": grad}) is None
    leak = grad.clone()
    leak[1000:1100] = x[17]
    assert "input row" in guard.violation(0, {"g": leak})


def test_a_tensor_with_fewer_non_zero_row_values_than_the_sparsest_row_is_not_scanned():
    """Zeros are row values of one-hot and image rows, and gradients are full of them: the shortcut also counts the
    non-zero row values against the sparsest checked row's, and a row among enough of them is still found."""
    from pflkit.core.engine.privacy import PrivacyGuard, _ClientRows, _RollingHash

    x = torch.zeros(4, 12)
    x[0, [1, 4, 9]] = 1.0
    x[1, [0, 2, 5, 7]] = 1.0
    x[2, [3, 6, 8, 10, 11]] = 1.0
    rows = _ClientRows([x], [], _RollingHash())  # row 3 is constant (all zeros): not checked
    assert rows.zero_is_value and rows.min_nonzero == 3
    grad = torch.randn(500) * 0.1
    grad[::2] = 0.0
    grad[7], grad[100] = 1.0, 1.0  # two non-zero row values: fewer than the sparsest row's three
    assert not rows.may_hold_a_row(grad) and rows.none_may_hold_a_row([grad])
    grad[300] = 1.0
    assert rows.may_hold_a_row(grad) and not rows.none_may_hold_a_row([grad])
    guard = PrivacyGuard()
    guard.register(0, [x], [])
    assert guard.violation(0, {"g": grad}) is None
    grad[200:212] = x[0]
    assert "input row" in guard.violation(0, {"g": grad})
