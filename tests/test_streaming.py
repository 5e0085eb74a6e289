"""Streaming aggregation (core/api/fold.py): mean fields are folded as replies arrive, a round never holds every
upload or every rollback snapshot, and the numbers are today's within the stated bound."""
import weakref

import pytest
import torch
from click.testing import CliRunner

from pflkit.core.engine.backend import SerialBackend
from pflkit.core.cli.main import cli
from pflkit.core.api.fold import MeanFold
from pflkit.core.api.state import weighted_average
from pflkit.core.testing import (OneTrainerPerClient, assert_streaming_matches_all_replies, fold_tolerance,
                                 one_process_group, tiny_simulation)


def _states(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(40, 30, generator=g) * (i + 1), "b": torch.randn(30, generator=g),
             "n": torch.tensor(i + 7)} for i in range(k)]


def test_fold_is_the_weighted_mean_within_the_stated_bound_and_deterministic():
    states, weights = _states(25), [float(3 + 5 * i) for i in range(25)]

    def fold_all():
        fold = MeanFold(("params",))
        for cid, (s, w) in enumerate(zip(states, weights)):
            rest, problem = fold.add(cid, {"params": s, "num_samples": w, "train_loss": 0.5})
            assert problem is None and rest == {"params": None, "num_samples": w, "train_loss": 0.5}
        return fold.means(torch.device("cpu"))["params"]

    mean = fold_all()
    assert mean.weight == sum(weights)
    assert all(torch.equal(mean.state[k], v) for k, v in fold_all().state.items())  # same order: same bits
    assert torch.equal(mean.state["n"], states[0]["n"])  # integer keys: the first client's, as weighted_average
    old = weighted_average(states, weights)
    tol = fold_tolerance(states)
    for k in ("w", "b"):
        exact = sum(s[k].double() * w for s, w in zip(states, weights)) / sum(weights)
        assert mean.state[k].dtype == torch.float32
        assert float((mean.state[k].double() - exact).abs().max()) <= tol  # the true mean, within K roundings
        assert float((mean.state[k] - old[k]).abs().max()) <= tol  # and the all-replies path's


def test_half_precision_uploads_are_summed_in_float32():
    states = [{"w": torch.full((3,), 1.0 + 2.0 ** -10, dtype=torch.float16)} for _ in range(3000)]
    fold = MeanFold(("params",))
    for cid, s in enumerate(states):
        fold.add(cid, {"params": s, "num_samples": 1})
    mean = fold.means(torch.device("cpu"))["params"].state["w"]
    assert mean.dtype == torch.float16 and torch.equal(mean, states[0]["w"])  # a float16 sum would have stalled


def test_fold_refuses_a_reply_it_cannot_fold_and_keeps_its_sums():
    a, b = _states(2)
    fold = MeanFold(("params",))
    assert fold.add(0, {"params": a, "num_samples": 4})[1] is None
    before = [a.clone() for a in fold.folds["params"].acc]
    _, problem = fold.add(1, {"params": {"w": b["w"]}, "num_samples": 4})
    assert "other keys, shapes or dtypes than client 0" in problem
    _, problem = fold.add(2, {"params": [b["w"]], "num_samples": 4})
    assert "not a dict of tensors" in problem
    _, problem = fold.add(3, {"params": b})
    assert "num_samples" in problem
    assert all(torch.equal(a, b) for a, b in zip(fold.folds["params"].acc, before))
    assert fold.folds["params"].weight == 4
    uniform = MeanFold(("params",), weight_of=lambda reply: 1.0)  # a strategy's own weight needs no num_samples
    assert uniform.add(0, {"params": a})[1] is None


class UploadWatch(SerialBackend):
    """Counts, as each client starts, the earlier clients' uploads and rollback snapshots still alive."""

    def __init__(self):
        super().__init__()
        self.uploads, self.max_alive, self.max_snapshots = [], 0, 0

    def start(self, build_trainer, client_ids, state_options=None):
        super().start(build_trainer, client_ids, state_options)

    def _run_one(self, cid, call, snapshot):
        self.max_alive = max(self.max_alive, sum(ref() is not None for ref in self.uploads))
        held = len(self.pool.store._prev) if self.pool is not None else len(self._snapshots)
        self.max_snapshots = max(self.max_snapshots, held)
        res = super()._run_one(cid, call, snapshot)
        if res.error is None and "params" in res.reply:
            self.uploads.append(weakref.ref(next(iter(res.reply["params"].values()))))
        return res


class LegacyUploadWatch(UploadWatch):
    def start(self, build_trainer, client_ids, state_options=None):
        SerialBackend.start(self, lambda cid: build_trainer(cid), client_ids)  # one trainer per client


@pytest.mark.parametrize("backend_cls", [UploadWatch, LegacyUploadWatch])
def test_a_streaming_round_holds_one_upload_and_one_snapshot_at_a_time(tmp_path, backend_cls):
    over = {"partition": {"num_clients": 6}, "rounds": 1}
    streamed = tiny_simulation("fedavg", tmp_path / "stream", over, backend=backend_cls())
    streamed.run()
    assert (streamed.backend.pool is None) == (backend_cls is LegacyUploadWatch)
    assert len(streamed.backend.uploads) >= 6 and streamed.backend.max_alive == 0
    assert streamed.backend.max_snapshots == 0  # an accepted client's snapshot went before the next one ran
    whole = tiny_simulation("fedavg", tmp_path / "all", over, backend=backend_cls())
    whole.comm.mean_fields = ()  # the all-replies path keeps them all until the aggregator combines them
    whole.run()
    assert whole.backend.max_alive >= 5  # every earlier upload, still held when the last client trains


# every aggregator of the shipped algorithms whose aggregation is a weighted mean (on the tiny MLP; the
# head/body-split methods get the tiny config's mlp, which has one); l2gd needs every client in every round
STREAMING = ["fedavg", "fedprox", "fedper", "fedrep", "fedbn", "fedrod", "ditto", "fedcp", "fedntd", "fedbabu",
             "lgfedavg", "perfedavg", "apfl", "fedala", "fedphp", "pfedme"]
ALL_REPLIES = ["fedsa", "fedcac", "fedc2i", "fedproto", "fedamp", "fedfomo", "fedgen", "fedmtl", "ifca", "netlasso"]


@pytest.mark.parametrize("variant", STREAMING)
def test_streaming_matches_all_replies(tmp_path, variant):
    name, *sets = variant.split("+")
    assert_streaming_matches_all_replies(name, {"partition": {"num_clients": 5}}, tmp_path, tuple(sets))


def test_l2gd_streams_its_averaging_step(tmp_path):
    # seed 0's coin (p 0.5): rounds 1-3 average nothing yet, round 4 is a local step, round 5 collects every x_i
    assert_streaming_matches_all_replies("l2gd", {"partition": {"num_clients": 5}}, tmp_path,
                                         ("aggregator.p=0.5",), rounds=5)


@pytest.mark.parametrize("name", ALL_REPLIES)
def test_strategies_that_need_every_upload_do_not_stream(name):
    from pflkit.core.api import registry as reg

    algo = reg.ALGORITHMS.get(name)
    assert reg.AGGREGATORS.get(algo.aggregator).reduced_fields() == ()


def test_legacy_trainers_stream_too(tmp_path):
    """A strategy's fold does not depend on how clients run (pooled or one trainer per client)."""
    a = tiny_simulation("fedavg", tmp_path / "pooled", {"rounds": 1})
    b = tiny_simulation("fedavg", tmp_path / "legacy", {"rounds": 1}, backend=OneTrainerPerClient())
    a.run(), b.run()
    assert all(torch.equal(x, b.server.global_state[k]) for k, x in a.server.global_state.items())


def test_fl_show_says_how_an_aggregator_receives_replies():
    out = CliRunner().invoke(cli, ["show", "fedavg"]).output
    assert "aggregation: streaming" in out and "'params'" in out
    out = CliRunner().invoke(cli, ["show", "fedsa"]).output
    assert "aggregation: all replies at once" in out


@pytest.fixture
def one_rank_group():
    with one_process_group():
        yield


@pytest.mark.parametrize("exact", [True, False])
def test_distributed_paths_fold_like_the_serial_run(tmp_path, one_rank_group, exact):
    """One mechanism: a process folds its clients' replies with the serial run's fold (then all-reduces the sums,
    or gathers the replies and folds them in client order); with one process both are the serial numbers bit for
    bit (two processes: tests/test_distributed.py, slow)."""
    from pflkit.core.distributed.backend import DistributedBackend

    over = {"rounds": 2, "distributed": {"exact": exact}}
    dist_run = tiny_simulation("fedavg", tmp_path / "dist", over, backend=DistributedBackend())
    dist_run.run()
    serial = tiny_simulation("fedavg", tmp_path / "serial", over)
    serial.run()
    assert all(torch.equal(v, dist_run.server.global_state[k]) for k, v in serial.server.global_state.items())
