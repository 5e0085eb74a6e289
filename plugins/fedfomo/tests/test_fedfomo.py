"""FedFomo: the first-order weights and update on hand-made tensors, the epsilon-greedy choice, the validation
split, one candidate = the candidate itself (or the client's own model), no candidate and no validation split =
Local bit for bit, the downlink counting M models, pooled = one trainer per client, resume (also with a spilling
server store), bad input, --workers 2 = serial (slow)."""
import os

import numpy as np
import pytest
import torch

from pflkit.core import Simulation, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records,
                                 run_capturing_replies, tiny_config, tiny_run)
from pflkit_fedfomo import (FedFomoTrainer, choose_candidates, epsilon_at, fomo_update, fomo_weights, normalised,
                            state_distance, update_affinity, validation_split)

# iid shards: other clients' models do help on a client's validation split, so P and the update are exercised
OVER = {"rounds": 3, "partition": {"num_clients": 5, "name": "iid"}, "aggregator": {"candidates": 2}}


def run(tmp_path, name, algorithm="fedfomo", sets=(), over=OVER, **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- equations on hand-made tensors ------------------------------------------------------------------------------
def test_first_order_weights_and_update_on_hand_made_tensors():
    # own loss 1.0; candidates: better by 0.6 at distance 2, worse, better by 0.2 at distance 0.5, identical to own
    w = fomo_weights(1.0, [0.4, 1.5, 0.8, 0.1], [2.0, 1.0, 0.5, 0.0])
    assert torch.allclose(w, torch.tensor([0.3, 0.0, 0.4, 0.0], dtype=torch.float64))
    assert torch.allclose(normalised(w), torch.tensor([3 / 7, 0, 4 / 7, 0], dtype=torch.float64))
    own = torch.tensor([1.0, 1.0])
    cands = [torch.tensor([3.0, 1.0]), torch.tensor([9.0, 9.0]), torch.tensor([1.0, -6.0]), own.clone()]
    new = fomo_update(own, cands, w)
    # theta_i + sum_n (w_n / sum w)(theta_n - theta_i) = own + 3/7 (2, 0) + 4/7 (0, -7)
    assert torch.allclose(new, torch.tensor([1 + 6 / 7, 1 - 4.0]))
    # nothing improves: the client keeps its own model
    assert torch.equal(fomo_update(own, cands[:2], fomo_weights(0.1, [0.4, 1.5], [2.0, 1.0])), own)
    # equal weights: the plain mean of the candidates (FedAvg of the improving candidates, uniform)
    even = fomo_update(own, cands[:2], torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(even, (cands[0] + cands[1]) / 2)
    a, b = {"x": torch.tensor([0.0, 3.0]), "y": torch.tensor([4.0])}, {"x": torch.zeros(2), "y": torch.zeros(1)}
    assert state_distance(a, b, ["x", "y"]) == pytest.approx(5.0) and state_distance(a, b, ["y"]) == 4.0


def test_one_improving_candidate_is_taken_bit_for_bit():
    own, theta = torch.randn(7), torch.randn(7)
    assert torch.equal(fomo_update(own, [theta], torch.tensor([0.37], dtype=torch.float64)), theta)
    assert torch.equal(fomo_update(own, [theta], torch.tensor([0.0], dtype=torch.float64)), own)


def test_epsilon_schedule_and_affinity_update():
    assert epsilon_at(0.3, 0.05, 1) == 0.3 and epsilon_at(0.3, 0.05, 3) == pytest.approx(0.2)
    assert epsilon_at(0.3, 0.05, 100) == 0.0 and epsilon_at(0.3, 0.0, 50) == 0.3
    p = torch.zeros(3, 3, dtype=torch.float64)
    update_affinity(p, 0, [2, 1], torch.tensor([0.5, 0.0], dtype=torch.float64))
    update_affinity(p, 0, [2], torch.tensor([0.25], dtype=torch.float64))
    assert p[0, 2] == 0.75 and p[0, 1] == 0 and float(p.sum()) == 0.75


def test_epsilon_greedy_choice():
    row = np.array([0.0, 5.0, 1.0, 3.0, 3.0, 0.5])
    pool = [1, 2, 3, 4, 5]
    greedy = choose_candidates(row, pool, 3, 0.0, np.random.default_rng(0))
    assert greedy[0] == 1 and sorted(greedy[1:]) == [3, 4]  # the top 3 of the row (tie 3/4 broken at random)
    ties = {tuple(choose_candidates(row, pool, 2, 0.0, np.random.default_rng(s))) for s in range(20)}
    assert ties == {(1, 3), (1, 4)}
    explored = [tuple(choose_candidates(row, pool, 2, 1.0, np.random.default_rng(s))) for s in range(40)]
    assert len(set(explored)) > 6 and all(len(set(c)) == 2 and set(c) <= set(pool) for c in explored)
    assert choose_candidates(row, pool, 9, 0.5, np.random.default_rng(0)) == pool  # M >= pool: all of them
    assert choose_candidates(row, [], 3, 0.5, np.random.default_rng(0)) == []
    same = [choose_candidates(row, pool, 3, 0.3, np.random.default_rng(7)) for _ in range(2)]
    assert same[0] == same[1]  # the server's seeded rng makes the choice reproducible


def test_validation_split_is_seeded_disjoint_and_a_fifth():
    tr, va = validation_split(50, 0.2, seed=3, cid=4)
    assert len(va) == 10 and len(tr) == 40 and not set(tr.tolist()) & set(va.tolist())
    assert sorted(tr.tolist() + va.tolist()) == list(range(50))
    again = validation_split(50, 0.2, seed=3, cid=4)
    assert torch.equal(again[1], va) and not torch.equal(validation_split(50, 0.2, seed=3, cid=5)[1], va)
    assert len(validation_split(3, 0.2, 0, 0)[1]) == 1 and len(validation_split(1, 0.2, 0, 0)[1]) == 0


# -- the client ----------------------------------------------------------------------------------------------------
def _trainer(tmp_path):
    sim = Simulation(tiny_config("fedfomo", OVER), run_dir=tmp_path / "r", tensorboard=False)
    return sim, FedFomoTrainer(sim.contexts[1])


def test_one_candidate_replaces_the_model_when_it_validates_better_else_is_ignored(tmp_path):
    sim, t = _trainer(tmp_path)
    own = {k: v.clone() for k, v in t.model.state_dict().items()}
    # a candidate trained on this client's own training split validates better than the untrained model
    donor = FedFomoTrainer(sim.contexts[1])
    donor.on_fit({})
    better = {k: v.clone() for k, v in donor.model.state_dict().items()}
    w = t.first_order_update([better])
    assert float(w[0]) > 0 and same_state(t.model.state_dict(), better)  # moved all the way: the candidate itself
    # now the client holds the better model: the untrained one does not help and is ignored
    w = t.first_order_update([own])
    assert float(w[0]) == 0 and same_state(t.model.state_dict(), better)


def test_fit_reply_and_validation_part_never_trained_on(tmp_path):
    sim, t = _trainer(tmp_path)
    train, val = t.splits()
    assert len(train) + len(val) == sim.contexts[1].num_train and len(val) == round(0.2 * sim.contexts[1].num_train)
    reply = t.on_fit({"candidates": {3: t.model.state_dict(), 0: t.scratch.state_dict()}})
    assert reply["weighed"] == [0, 3] and reply["weights"].shape == (2,) and reply["num_samples"] == len(train)
    assert reply["metrics"]["candidates"] == 2


def test_no_candidate_and_no_validation_split_is_local_bit_for_bit(tmp_path):
    over = {**OVER, "aggregator": {"candidates": 0}, "trainer": {"val_ratio": 0.0}}
    _, a = run(tmp_path, "fomo", over=over)
    _, b = run(tmp_path, "local", "local", over={"rounds": 3, "partition": {"num_clients": 5, "name": "iid"}})
    # Local uploads nothing; FedFomo uploads each model (the next round's candidates) and its candidate count
    drop = ("bytes_up", "fedfomo/", "clients/improving_candidates", "clients/candidates")
    assert metrics_records(tmp_path / "fomo", drop=drop) == metrics_records(tmp_path / "local", drop=("bytes_up",))
    assert a["final"] == b["final"]


def test_downlink_counts_every_candidate_model_and_affinity_accumulates(tmp_path):
    sim = Simulation(tiny_config("fedfomo", OVER), run_dir=tmp_path / "fomo", tensorboard=False)
    replies = run_capturing_replies(sim)
    recs = metrics_records(tmp_path / "fomo")
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.models.get(0).values())
    assert recs[0]["bytes_down"] == 0  # round 1: nothing stored yet, everyone trains alone
    for rec in recs[1:]:  # then M = 2 whole models to each of the 5 selected clients
        assert rec["bytes_down"] == 5 * 2 * model_bytes
    assert sim.server.models.ids() == [0, 1, 2, 3, 4]
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for rnd in sorted(replies):
        for cid, reply in replies[rnd].items():
            assert len(reply["weighed"]) == (0 if rnd == 1 else 2) and cid not in reply["weighed"]
            for n, w in zip(reply["weighed"], reply["weights"].tolist()):
                expected[cid, n] += w
    assert torch.equal(sim.server.affinity, expected) and float(expected.sum()) > 0  # P[i, n] = sum of w_n
    for cid in range(5):  # each client's model in the store is its last upload
        assert same_state(sim.server.models.get(cid), replies[3][cid]["params"])


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("fedfomo", OVER, tmp_path)
    for cid in pooled.client_ids:
        assert same_state(pooled.backend.trainers[cid].state_dict(), legacy.backend.trainers[cid].state_dict())
    assert torch.equal(pooled.server.affinity, legacy.server.affinity)


@pytest.mark.parametrize("budget", [None, 0])
def test_resume_reaches_the_same_numbers(tmp_path, budget):
    assert_resume_matches_full_run("fedfomo", {**OVER, "server": {"state_memory": budget}}, tmp_path)


def test_a_server_budget_spills_the_models_with_the_same_numbers(tmp_path):
    free, a = run(tmp_path, "free")
    tight, b = run(tmp_path, "tight", sets=("server.state_memory=0",))
    assert tight.server_stores.spilled == len(tight.server.models) == 5 and free.server_stores.spilled == 0
    assert metrics_records(tmp_path / "free") == metrics_records(tmp_path / "tight") and a["final"] == b["final"]


@pytest.mark.parametrize("sets, message", [
    (("aggregator.candidates=-1",), "aggregator.candidates: -1 is invalid: must be >= 0"),
    (("aggregator.epsilon=1.5",), "aggregator.epsilon: 1.5 is invalid: must lie in [0, 1]"),
    (("aggregator.epsilon_decay=-0.1",), "aggregator.epsilon_decay: -0.1 is invalid"),
    (("trainer.val_ratio=1",), "trainer.val_ratio: 1.0 is invalid: must lie in [0, 1)"),
    (("trainer.val_ratio=0",), "trainer.val_ratio: 0 leaves no validation split"),
    (("aggregator.candidates=many",), "aggregator.candidates: expected int"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedfomo", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedfomo", {**OVER, "server": {"state_memory": 0}}, tmp_path)
