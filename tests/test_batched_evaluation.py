"""Batched evaluation (clients.batched, core/engine/batched_eval.py): where the fit is batched and the evaluation is
the core's default one, every client's personal model is scored in one vectorised pass, with the sums of the
per-client path; anything else falls back to it."""
import random

import numpy as np
import pytest
import torch

from pflkit.core import LocalSGDTrainer
from pflkit.core.engine import batched_eval as BE
from pflkit.core.engine.backend import Call
from pflkit.core.api.protocol import Message
from pflkit.core.testing import OneTrainerPerClient, tiny_run, tiny_simulation

MLP = {"partition": {"num_clients": 6}, "model": {"name": "mlp", "hidden": [24]}, "train": {"batch_size": 10},
       "rounds": 3}
BN_MODEL = {"model": {"name": "fedbn_cnn", "channels": [4], "hidden": [8]}}
ON = ("clients.batched=on",)


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _rng_state():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _evaluate_both_ways(sim):
    """After each of ``sim``'s evaluations, its clients scored again on the same states one at a time (the batched
    evaluation turned off for that exchange): round -> (batched replies, per-client replies, RNG states alike)."""
    seen = {}
    original = sim.evaluate_all
    runner = sim.backend.batched

    def both(rnd):
        messages = sim.server.configure_evaluate(rnd, sim.client_ids)
        before = runner.evaluations_run
        batched = sim.comm.send(messages, accounted=False)
        batched_rng = _rng_state()
        ran = runner.evaluations_run - before
        runner.evaluation_refused = True
        sim.comm._calls -= 1  # the same calls again: the same seeds
        try:
            one_by_one = sim.comm.send(messages, accounted=False)
        finally:
            runner.evaluation_refused = False
        seen[rnd] = (ran, batched, one_by_one, batched_rng, _rng_state())
        return original(rnd)

    sim.evaluate_all = both
    return seen


def _assert_same_sums(batched, one_by_one, where=""):
    assert batched.keys() == one_by_one.keys(), where
    for cid, exact in one_by_one.items():
        got = batched[cid]
        assert got.keys() == exact.keys(), f"{where} client {cid}"
        assert got["num_samples"] == exact["num_samples"]
        assert got.get("val_num_samples") == exact.get("val_num_samples")
        for key in ("metric_sum", "val_metric_sum"):  # correct predictions: counts, exactly
            assert got.get(key) == exact.get(key), f"{where} client {cid} {key}"
        for key in ("loss_sum", "val_loss_sum"):
            if key in exact:
                assert isinstance(got[key], float)
                assert got[key] == pytest.approx(exact[key], rel=1e-4, abs=1e-6), f"{where} client {cid} {key}"


CASES = {
    "fedavg": ("fedavg", {}, ()),  # one model for every client: one plain pass
    "fedavg-val": ("fedavg", {}, ("split.val=0.2",)),
    "fedper-val": ("fedper", {}, ("split.val=0.2",)),  # personal heads: the vmapped pass over padded groups
    "fedbn": ("fedbn", BN_MODEL, ()),  # per-client BatchNorm statistics, in eval mode under vmap
    "fedprox": ("fedprox", {}, ("trainer.mu=0.1",)),  # a receive() of its own, called on each client's trainer
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_evaluation_gives_the_per_client_sums(tmp_path, case):
    algorithm, over, sets = CASES[case]
    sim = tiny_simulation(algorithm, tmp_path, _merge(MLP, over), ON + sets)
    seen = _evaluate_both_ways(sim)
    sim.run()
    assert sim.batched_plan.evaluation is None
    assert sorted(seen) == [1, 2, 3]
    for rnd, (ran, batched, one_by_one, batched_rng, exact_rng) in seen.items():
        assert ran == 1, f"round {rnd}: the batched evaluation did not run"
        _assert_same_sums(batched, one_by_one, f"round {rnd}")
        if "val" in case:
            assert all("val_loss_sum" in r for r in batched.values())
        # the process RNGs end as after the per-client path
        assert torch.equal(batched_rng[0], exact_rng[0]) and np.array_equal(batched_rng[1], exact_rng[1])
        assert batched_rng[2] == exact_rng[2]
    assert sim.backend.batched.evaluations_run == 3 + 3  # the run's own evaluations, and the ones above
    assert sim.backend.batched.evaluation_fallbacks == 0


def test_live_trainers_are_scored_alike(tmp_path):
    sim = tiny_simulation("fedper", tmp_path, MLP, ON, backend=OneTrainerPerClient())
    seen = _evaluate_both_ways(sim)
    sim.run()
    assert sim.backend.pool is None
    for rnd, (ran, batched, one_by_one, _, _) in seen.items():
        assert ran == 1
        _assert_same_sums(batched, one_by_one, f"round {rnd}")


def test_the_run_ends_with_the_sequential_runs_numbers(tmp_path):
    """The batched run against the batched fit with per-client evaluation: the same records, to float rounding."""
    _, batched = tiny_run("fedper", tmp_path / "bat", MLP, ON + ("split.val=0.2",))
    sim = tiny_simulation("fedper", tmp_path / "one", MLP, ON + ("split.val=0.2",))
    sim.backend.batched.evaluation_refused = True
    one = sim.run()
    assert sim.backend.batched.evaluations_run == 0
    for key in ("uniform", "weighted"):
        assert batched["final"][key] == pytest.approx(one["final"][key], rel=1e-4)


class OwnEvaluation(LocalSGDTrainer):
    """Batches its fit (LocalSGDTrainer's form), scores its own way: the batched evaluation must not replace it."""

    declares_state = True
    calls = 0

    def evaluate_model(self, forward, modules=()):
        OwnEvaluation.calls += 1
        return super().evaluate_model(forward, modules)


def test_a_trainer_that_overrides_its_evaluation_is_scored_one_client_at_a_time(tmp_path, registries_snapshot):
    registries_snapshot.TRAINERS.register("own_evaluation", OwnEvaluation)
    OwnEvaluation.calls = 0
    over = _merge(MLP, {"trainer": {"name": "own_evaluation"}})
    sim = tiny_simulation("fedavg", tmp_path / "own", over, ON)
    res = sim.run()
    runner = sim.backend.batched
    assert runner.groups_run == 3 and runner.evaluations_run == 0  # the fit batched, the evaluation not
    assert "OwnEvaluation overrides evaluate_model()" in sim.batched_plan.evaluation
    # the summary and run_info say how the evaluations were scored
    assert res["clients_batched"]["evaluation"].startswith("per client: OwnEvaluation overrides")
    assert res["clients_batched"]["evaluations_batched"] == 0 and res["clients_batched"]["groups_run"] == 3
    assert OwnEvaluation.calls == 3 * 6
    # the same numbers as FedAvg's trainer, whose evaluation is batched (the same batched fit)
    fedavg, ref = tiny_run("fedavg", tmp_path / "fedavg", MLP, ON)
    assert fedavg.backend.batched.evaluations_run == 3
    assert ref["clients_batched"]["evaluation"] == "batched" and ref["clients_batched"]["evaluations_batched"] == 3
    import json

    info = json.loads((tmp_path / "fedavg" / "run_info.json").read_text())["entries"][0]["clients_batched"]
    assert info["evaluation"] == "batched"
    for key in ("uniform", "weighted"):
        assert res["final"][key] == pytest.approx(ref["final"][key], rel=1e-4)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_off_and_auto_on_a_cpu_never_batch_the_evaluation(tmp_path, mode, monkeypatch):
    used = []
    monkeypatch.setattr(BE, "run", lambda *a, **k: used.append(a) or iter(()))
    sim, res = tiny_run("fedavg", tmp_path, MLP, (f"clients.batched={mode}", "device=cpu"))
    assert not sim.batched_plan.batched and sim.backend.batched is None
    assert not used and res["rounds_completed"] == 3


def test_evaluation_time_adaptation_is_scored_one_client_at_a_time(tmp_path):
    sim, res = tiny_run("fedavg", tmp_path, MLP, ON + ("eval.adapt=every", "eval.adapt_steps=1"))
    assert sim.backend.batched.evaluations_run == 0 and sim.backend.batched.groups_run == 3
    assert res["rounds_completed"] == 3


def _per_client_records(sim):
    seen = {}
    original = sim.evaluate_all

    def keep(rnd):
        summary = original(rnd)
        seen[rnd] = {cid: dict(r) for cid, r in sim.last_results.items()}
        return summary

    sim.evaluate_all = keep
    return seen


def test_a_failing_pass_falls_back_to_the_per_client_numbers(tmp_path, monkeypatch):
    exact = tiny_simulation("fedper", tmp_path / "exact", MLP, ON)
    exact.backend.batched.evaluation_refused = True  # the batched fit, every evaluation one client at a time
    exact_seen = _per_client_records(exact)
    exact.run()
    sim = tiny_simulation("fedper", tmp_path / "failing", MLP, ON)
    seen = _per_client_records(sim)

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(BE, "score_stacked", broken)
    res = sim.run()
    runner = sim.backend.batched
    # tried once, then the run evaluates one client at a time
    assert runner.evaluation_fallbacks == 1 and runner.evaluation_refused and runner.evaluations_run == 0
    assert res["clients_batched"]["evaluation_fallbacks"] == 1
    assert not sim.failures and res["client_failures"] == 0
    assert seen == exact_seen  # scored one at a time from the states received: the same numbers exactly


def test_a_client_that_cannot_be_swapped_in_fails_alone(tmp_path, registries_snapshot):
    class Fragile(LocalSGDTrainer):
        declares_state = True

        def load_client_state(self, state):
            if self.ctx.cid == 1 and self.ctx.round >= 1 and getattr(self, "_evaluating", False):
                raise ValueError("corrupt state")
            super().load_client_state(state)

    registries_snapshot.TRAINERS.register("fragile_eval", Fragile)
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1, "trainer": {"name": "fragile_eval"}}), ON)
    original = sim.evaluate_all

    def evaluating(rnd):  # the working trainer refuses client 1's state while the evaluation swaps it in
        trainer = sim.backend.pool.trainer
        trainer._evaluating = True
        try:
            return original(rnd)
        finally:
            trainer._evaluating = False

    sim.evaluate_all = evaluating
    res = sim.run()
    assert sim.backend.batched.evaluations_run == 1
    failed = [f for f in sim.failures if f["kind"] == "evaluate"]
    assert [f["client"] for f in failed] == [1] and "corrupt state" in failed[0]["reason"]
    assert res["rounds_completed"] == 1


def test_a_single_client_or_another_message_is_not_batched(tmp_path):
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1}), ON)
    runner = sim.backend.batched
    evaluate = Call(Message("evaluate", {}), 1, 1)
    assert runner.scores(sim.backend, {0: evaluate, 1: evaluate})
    assert not runner.scores(sim.backend, {0: evaluate})
    assert not runner.scores(sim.backend, {0: evaluate, 1: Call(Message("evaluate", None), 1, 1)})
    assert not runner.scores(sim.backend, {0: evaluate, 1: Call(Message("fit", {}), 1, 1)})


def test_which_trainers_evaluation_batches():
    from pflkit.core import TRAINERS

    assert BE.evaluation_reason(TRAINERS.get("fedavg")) is None
    assert BE.evaluation_reason(TRAINERS.get("fedper")) is None
    assert "personal_forward" in BE.evaluation_reason(TRAINERS.get("ditto"))
    assert "on_evaluate" in BE.evaluation_reason(TRAINERS.get("fedrod"))
    assert BE.evaluation_reason(TRAINERS.get("fedcp")) is not None


@pytest.mark.parametrize("task", ["classification", "regression-1", "regression-3"])
def test_per_sample_sums_add_up_to_the_evaluation_sums(task):
    from pflkit.core.api.task import classification, regression
    from pflkit.core.api.training import _loss_sum

    g = torch.Generator().manual_seed(0)
    if task == "classification":
        t, out, y = classification(5), torch.randn(17, 5, generator=g), torch.randint(0, 5, (17,), generator=g)
    else:
        d = int(task[-1])
        t, out = regression(d), torch.randn(17, d, generator=g)
        y = torch.randn(17, generator=g) if d == 1 else torch.randn(17, d, generator=g)
    loss, metric = BE.per_sample_sums(t, out, y)
    assert loss.shape == metric.shape == (17,)
    assert float(loss.sum()) == pytest.approx(float(_loss_sum(t, out, y)), rel=1e-6)
    assert float(metric.float().sum()) == pytest.approx(float(t.metric_sum(out, y)), rel=1e-6)
