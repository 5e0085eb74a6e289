"""Replies the core must not trust (issue 29, H1 and H2), tried as a buggy plugin would: the lowest-id client sends
a malformed fit or evaluate reply. The core checks each reply against what it expects itself (the layout the
server declares, the client's own split sizes, evaluation sums over its test split), never against another reply:
only that client is rejected, counted and logged, and the round is what the honest replies make it."""
import json
import math

import pytest
import torch

from pflkit.core import LocalSGDTrainer
from pflkit.core.engine.evaluation import summarize
from pflkit.core.api.fold import MeanFold, layout_of
from pflkit.core.testing import fold_tolerance, one_process_group, tiny_simulation

BAD = 0  # the client that sends the malformed reply: the lowest id, folded first


class Malformed(LocalSGDTrainer):
    """Client ``BAD`` changes its fit reply with ``fit_change`` and its evaluate reply with ``eval_change``; every
    client records what it sent honestly (the upload and count, the evaluation sums)."""

    fit_change = None
    eval_change = None
    uploads: dict = {}
    evaluations: dict = {}

    def on_fit(self, payload):
        reply = super().on_fit(payload)
        type(self).uploads[self.ctx.cid] = ({k: v.clone() for k, v in reply["params"].items()}, reply["num_samples"])
        if self.ctx.cid == BAD and type(self).fit_change is not None:
            type(self).fit_change(reply)
        return reply

    def on_evaluate(self, payload):
        reply = super().on_evaluate(payload)
        type(self).evaluations[self.ctx.cid] = dict(reply)
        if self.ctx.cid == BAD and type(self).eval_change is not None:
            type(self).eval_change(reply)
        return reply


# serial streaming (FedAvg folds uploads as they arrive), serial all-replies (the aggregator gets every upload),
# and the distributed backend's two paths (exact: replies gathered and folded in client order; fast: each rank
# folds its own clients and the sums are all-reduced), on a one-process gloo group
PATHS = ("stream", "all", "exact", "fast")


def run(tmp_path, registries, path, fit=None, evaluate=None):
    trainer = type("MalformedOnce", (Malformed,), {"fit_change": staticmethod(fit) if fit else None,
                                                   "eval_change": staticmethod(evaluate) if evaluate else None,
                                                   "uploads": {}, "evaluations": {}})
    registries.TRAINERS.register("malformed", trainer, replace=True)
    over = {"trainer": {"name": "malformed"}, "rounds": 1, "distributed": {"exact": path != "fast"}}
    if path in ("exact", "fast"):
        from pflkit.core.distributed.backend import DistributedBackend

        with one_process_group():
            sim = tiny_simulation("fedavg", tmp_path / path, over, backend=DistributedBackend())
            summary = sim.run()
    else:
        sim = tiny_simulation("fedavg", tmp_path / path, over)
        if path == "all":
            sim.comm.mean_fields = ()
        summary = sim.run()
    record = json.loads((tmp_path / path / "metrics.jsonl").read_text().splitlines()[-1])
    return sim, summary, record, trainer


def assert_only_bad_rejected(sim, summary, kind, fragment):
    assert summary["client_failures"] == 1, sim.failures
    [failure] = sim.failures
    assert failure["client"] == BAD and failure["kind"] == kind and fragment in failure["reason"], failure
    assert "rejected" in (sim.run_dir / "run.log").read_text()


def assert_model_is_honest_mean(sim, trainer):
    honest = {cid: up for cid, up in trainer.uploads.items() if cid != BAD}
    assert sorted(honest) == [1, 2, 3]
    total = sum(n for _, n in honest.values())
    states = [s for s, _ in honest.values()]
    tol = fold_tolerance(states)
    glob = sim.server.global_state
    assert layout_of(glob) == layout_of(states[0])  # the server's model keeps its own keys, shapes and dtypes
    for k, v in glob.items():
        exact = sum(s[k].double() * n for s, n in honest.values()) / total
        assert float((v.double() - exact).abs().max()) <= tol, k


# -- H1: one malformed upload from the lowest-id client ----------------------------------------------------------
def _first_weight(params):
    return next(k for k in params if k.endswith("weight"))


LAYOUTS = {
    "float64 params": (lambda r: r.update(params={k: v.double() for k, v in r["params"].items()}), "float64"),
    "float16 params": (lambda r: r.update(params={k: v.half() for k, v in r["params"].items()}), "float16"),
    "an int32-cast weight": (lambda r: r["params"].update({_first_weight(r["params"]):
                                                           r["params"][_first_weight(r["params"])].to(torch.int32)}),
                             "int32"),
    "an extra key": (lambda r: r["params"].update({"extra.buffer": torch.zeros(3)}), "extra.buffer"),
    "a missing key": (lambda r: r["params"].pop(_first_weight(r["params"])), "lacks key"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_malformed_upload_is_rejected_alone_on_every_path(tmp_path, registries_snapshot, name):
    change, fragment = LAYOUTS[name]
    for path in PATHS:
        sim, summary, _, trainer = run(tmp_path, registries_snapshot, path, fit=change)
        assert_only_bad_rejected(sim, summary, "fit", fragment)
        assert_model_is_honest_mean(sim, trainer)


# -- H2: counts the core knows ----------------------------------------------------------------------------------
COUNTS = {
    "negative": lambda n: -5,
    "a string": lambda n: str(n),
    "a bool": lambda n: True,
    "fractional": lambda n: n - 0.5,
    "zero": lambda n: 0,
    "10**9 more than it has": lambda n: n + 10 ** 9,
}


@pytest.mark.parametrize("name", list(COUNTS))
def test_a_fit_count_the_client_cannot_have_is_refused(tmp_path, registries_snapshot, name):
    count = COUNTS[name]
    for path in ("stream", "all", "fast"):
        sim, summary, _, trainer = run(tmp_path, registries_snapshot, path,
                                       fit=lambda r: r.update(num_samples=count(r["num_samples"])))
        assert_only_bad_rejected(sim, summary, "fit", "num_samples")
        assert_model_is_honest_mean(sim, trainer)


def test_an_honest_count_is_any_int_up_to_the_training_split(tmp_path, registries_snapshot):
    # a client may train on part of its split (FedFomo holds out a validation share): 1 is as good as all
    sim, summary, _, trainer = run(tmp_path, registries_snapshot, "stream", fit=lambda r: r.update(num_samples=1))
    assert summary["client_failures"] == 0


def _honest_summary(trainer):
    return summarize({cid: r for cid, r in trainer.evaluations.items() if cid != BAD})


def assert_evaluation_of_the_others(sim, summary, record, trainer, fragment):
    assert_only_bad_rejected(sim, summary, "evaluate", fragment)
    expected = _honest_summary(trainer)
    assert record["clients_evaluated"] == 3
    for key in ("accuracy/uniform", "accuracy/weighted", "accuracy/max", "test_loss/weighted"):
        assert record[key] == pytest.approx(expected[key], rel=1e-12), key
    assert 0.0 <= record["accuracy/max"] <= 1.0


EVALUATIONS = {
    "metric_sum 10 x n": (lambda r: r.update(metric_sum=10.0 * r["num_samples"]), "metric_sum"),
    "no metric_sum": (lambda r: r.pop("metric_sum"), "lacks 'metric_sum'"),
    "num_samples 10**9": (lambda r: r.update(num_samples=10 ** 9), "num_samples"),
    "num_samples 0": (lambda r: r.update(num_samples=0), "num_samples"),
    "a negative num_samples": (lambda r: r.update(num_samples=-3), "num_samples"),
    # the adaptation cost the round's summary adds up (adapt/steps, adapt/seconds): int("ten") was a traceback
    "adapt_steps a string": (lambda r: r.update(adapt_steps="ten", adapt_seconds=0.1), "adapt_steps (a str)"),
    "adapt_steps negative": (lambda r: r.update(adapt_steps=-5), "adapt_steps -5 is not a count"),
    "adapt_seconds NaN": (lambda r: r.update(adapt_steps=3, adapt_seconds=float("nan")), "adapt_seconds"),
}


@pytest.mark.parametrize("name", list(EVALUATIONS))
def test_a_bad_evaluate_reply_rejects_that_client_counted(tmp_path, registries_snapshot, name):
    change, fragment = EVALUATIONS[name]
    for path in ("stream", "fast"):
        sim, summary, record, trainer = run(tmp_path, registries_snapshot, path, evaluate=change)
        assert_evaluation_of_the_others(sim, summary, record, trainer, fragment)


def test_a_negative_or_non_finite_loss_sum_rejects_that_client(tmp_path, registries_snapshot):
    # (NaN and inf were refused before these checks existed, as any NaN/Inf reply; a negative sum was accepted)
    for value, fragment in ((-1.0, "loss_sum -1.0 is not a finite number >= 0"), (math.nan, "NaN/Inf"),
                            (math.inf, "NaN/Inf")):
        sim, summary, record, trainer = run(tmp_path / str(value), registries_snapshot, "stream",
                                            evaluate=lambda r: r.update(loss_sum=value))
        assert_evaluation_of_the_others(sim, summary, record, trainer, fragment)


def test_an_evaluate_reply_without_a_count_takes_the_cores(tmp_path, registries_snapshot):
    sim, summary, record, trainer = run(tmp_path, registries_snapshot, "stream", evaluate=lambda r: r.pop("num_samples"))
    assert summary["client_failures"] == 0
    expected = summarize(trainer.evaluations)
    assert record["accuracy/weighted"] == pytest.approx(expected["accuracy/weighted"], rel=1e-12)


# -- H2: a finite reply never overflows the round's sums ----------------------------------------------------------
def test_huge_finite_params_are_refused_before_they_overflow_the_sums(tmp_path, registries_snapshot):
    for path in ("stream", "fast"):
        sim, summary, record, trainer = run(
            tmp_path, registries_snapshot, path,
            fit=lambda r: r.update(params={k: v * 1e37 for k, v in r["params"].items()}))
        assert_only_bad_rejected(sim, summary, "fit", "overflow")
        assert_model_is_honest_mean(sim, trainer)
        assert math.isfinite(record["test_loss/weighted"])


def test_a_count_of_1e300_is_refused(tmp_path, registries_snapshot):
    sim, summary, _, trainer = run(tmp_path, registries_snapshot, "stream", fit=lambda r: r.update(num_samples=1e300))
    assert_only_bad_rejected(sim, summary, "fit", "num_samples")
    assert_model_is_honest_mean(sim, trainer)


def _states(k):
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(20, 10, generator=g), "b": torch.randn(10, generator=g)} for _ in range(k)]


def _sums(fold):
    ff = fold.folds["params"]
    return [a.clone() for a in ff.acc], ff.weight, ff.bound


@pytest.mark.parametrize("bad", ["params x 1e37", "weight 1e300", "weight 1e38 (within float32, not its sums)",
                                 "a zero weight", "a negative weight"])
def test_the_fold_refuses_a_reply_that_would_overflow_and_keeps_its_sums(bad):
    states = _states(4)
    weights = {"params x 1e37": 100.0, "weight 1e300": 1e300, "weight 1e38 (within float32, not its sums)": 1e38, "a zero weight": 0.0,
               "a negative weight": -2.0}
    layout = {"params": layout_of(states[0])}

    def weight_of(reply):
        return weights.get(bad, 3.0) if reply.get("bad") else 3.0

    fold = MeanFold(("params",), weight_of, layout)
    clean = MeanFold(("params",), weight_of, layout)
    for cid in (0, 1):
        assert fold.add(cid, {"params": states[cid]})[1] is None
        assert clean.add(cid, {"params": states[cid]})[1] is None
    before = _sums(fold)
    huge = {k: v * 1e37 for k, v in states[2].items()} if bad == "params x 1e37" else states[2]
    _, problem = fold.add(2, {"params": huge, "bad": True})
    assert problem is not None and ("overflow" in problem or "weight" in problem), problem
    after = _sums(fold)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]
    assert fold.add(3, {"params": states[3]})[1] is None and clean.add(3, {"params": states[3]})[1] is None
    got, want = fold.means(torch.device("cpu"))["params"], clean.means(torch.device("cpu"))["params"]
    assert all(torch.equal(got.state[k], want.state[k]) for k in want.state) and got.weight == want.weight


def test_the_fold_checks_the_declared_layout_even_for_the_first_reply():
    states = _states(3)
    fold = MeanFold(("params",), None, {"params": layout_of(states[0])})
    _, problem = fold.add(0, {"params": {k: v.double() for k, v in states[0].items()}, "num_samples": 5})
    assert problem is not None and "float64" in problem and not fold.folds["params"].folded
    for cid in (1, 2):
        assert fold.add(cid, {"params": states[cid], "num_samples": 5})[1] is None
    mean = fold.means(torch.device("cpu"))["params"]
    assert torch.allclose(mean.state["w"], (states[1]["w"] + states[2]["w"]) / 2)


# -- declarations: aggregators that upload something else, and a third-party streamed field -----------------------
def test_an_all_replies_aggregator_that_declares_its_uploads_rejects_a_malformed_one_alone(tmp_path,
                                                                                            registries_snapshot):
    # IFCA combines every upload itself (one mean per cluster) and declares what a fit reply's params hold
    base = registries_snapshot.TRAINERS.get("ifca")

    class Float64Ifca(base):
        def on_fit(self, payload):
            reply = super().on_fit(payload)
            if self.ctx.cid == BAD:
                reply["params"] = {k: v.double() for k, v in reply["params"].items()}
            return reply

    registries_snapshot.TRAINERS.register("ifca_float64", Float64Ifca)
    sim = tiny_simulation("ifca", tmp_path / "run", {"trainer": {"name": "ifca_float64"}, "rounds": 1})
    summary = sim.run()
    assert_only_bad_rejected(sim, summary, "fit", "float64")
    assert all(v.dtype == torch.float32 for m in sim.server.models for v in m.values() if v.is_floating_point())


class StatsTrainer(LocalSGDTrainer):
    """Uploads a second streamed field, ``stats``; client BAD's has an extra key when ``bad`` is set."""

    bad = False

    def on_fit(self, payload):
        reply = super().on_fit(payload)
        reply["stats"] = {"mean": torch.full((3,), float(self.ctx.cid))}
        if self.ctx.cid == BAD and self.bad:
            reply["stats"]["extra"] = torch.zeros(1)
        return reply


def _stats_aggregator(declared):
    from pflkit_fedavg import FedAvgAggregator

    from pflkit.core.api.fold import layout_of as lay

    class StatsAggregator(FedAvgAggregator):
        mean_fields = ("params", "stats")
        stats_mean = None

        def aggregate_fit(self, rnd, replies):
            if replies:
                type(self).stats_mean = self.mean_of(replies, "stats")
            return super().aggregate_fit(rnd, replies)

    if declared:
        def reply_layout(self, kind, field):
            if field == "stats":
                return lay({"mean": torch.zeros(3)})
            return FedAvgAggregator.reply_layout(self, kind, field)

        StatsAggregator.reply_layout = reply_layout
    return StatsAggregator


@pytest.mark.parametrize("declared", [False, True])
def test_a_streamed_field_is_checked_against_the_aggregators_declaration(tmp_path, registries_snapshot, declared):
    from pflkit.core.common.errors import PflError

    agg = _stats_aggregator(declared)
    registries_snapshot.AGGREGATORS.register("stats_agg", agg, replace=True)
    registries_snapshot.TRAINERS.register("stats", type("BadStats", (StatsTrainer,), {"bad": True}), replace=True)
    over = {"trainer": {"name": "stats"}, "aggregator": {"name": "stats_agg"}, "rounds": 1}
    sim = tiny_simulation("fedavg", tmp_path / "run", over)
    if not declared:  # nothing to check the field against but another reply: a plugin error, said in one line
        with pytest.raises(PflError, match="declares no layout for it"):
            sim.run()
        return
    summary = sim.run()
    assert_only_bad_rejected(sim, summary, "fit", "'stats' has key 'extra'")
    n = {c: len(sim.data.splits[c].train) for c in (1, 2, 3)}  # FedAvg's weights: the sample counts
    expected = sum(c * n[c] for c in n) / sum(n.values())
    assert torch.allclose(agg.stats_mean["mean"], torch.full((3,), expected))


def test_fold_mean_of_finite_states_is_finite_and_unchanged_otherwise():
    """A strategy that needs every upload (IFCA, FedGen, all-replies aggregation) folds them with fold_mean: finite
    uploads whose float32 running sums would pass the range still give their finite mean, in float32."""
    import torch

    from pflkit.core.api.fold import _fold_states, fold_mean

    big = [{"w": torch.full((3,), 2e38), "n": torch.tensor(5)}, {"w": torch.full((3,), 3e38), "n": torch.tensor(5)}]
    mean = fold_mean(big, [1.0, 1.0])
    assert mean["w"].dtype == torch.float32 and torch.isfinite(mean["w"]).all()
    assert mean["w"][0].item() == pytest.approx(2.5e38, rel=1e-6) and mean["n"].item() == 5
    assert not torch.isfinite(_fold_states(big, [1.0, 1.0])["w"]).all()  # what the float32 sums alone gave
    g = torch.Generator().manual_seed(0)
    small = [{"w": torch.randn(50, generator=g)} for _ in range(4)]
    weights = [3.0, 1.0, 7.0, 2.0]
    assert torch.equal(fold_mean(small, weights)["w"], _fold_states(small, weights)["w"])  # bit for bit as before
