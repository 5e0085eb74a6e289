"""IFCA: cluster choice, per-cluster averaging and recovery on hand-made values, the client's argmin choice, k = 1 =
FedAvg bit for bit, cluster recovery logged on digits_clusters, k models down, pooled = one trainer per client,
resume, bad input, --workers 2 = serial (slow)."""
import os

import pytest
import torch

from pflkit.core import Simulation, evaluate
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_ifca import IFCATrainer, choose_cluster, cluster_average, recovery

OVER = {"rounds": 3, "aggregator": {"clusters": 2}, "participation": {"join_ratio": 0.75}}
CLUSTERED = {"rounds": 3, "dataset": {"name": "digits_clusters", "num_clusters": 2, "clients_per_cluster": 2},
             "partition": {"name": "by_group", "num_clients": 4}, "aggregator": {"clusters": 2}}


def test_choice_averaging_and_recovery_on_hand_made_values():
    assert choose_cluster([0.7, 0.2, 0.9]) == 1 and choose_cluster([0.3, 0.3]) == 0  # ties: lowest index
    models = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}, {"w": torch.full((2,), 5.0)}]
    ups = [{"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([3.0, 5.0])}, {"w": torch.tensor([9.0, 9.0])}]
    out = cluster_average(models, ups, [1.0, 3.0, 1.0], [0, 0, 1])
    assert torch.allclose(out[0]["w"], torch.tensor([2.5, 4.5]))  # (1 * [1, 3] + 3 * [3, 5]) / 4
    assert torch.equal(out[1]["w"], ups[2]["w"]) and out[2] is models[2]  # no upload: unchanged
    assert recovery({0: 1, 1: 1, 2: 0, 3: 0}, [0, 0, 1, 1]) == 1.0  # perfect up to relabelling
    assert recovery({0: 0, 1: 1, 2: 0, 3: 1}, [0, 0, 1, 1]) < 0.1
    assert recovery({0: 0}, [0, 1]) is None


def test_the_client_trains_the_model_with_the_lowest_training_loss(tmp_path):
    sim = Simulation(tiny_config("ifca", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = IFCATrainer(sim.contexts[0])
    models = [{k: v.clone() for k, v in m.items()} for m in sim.server.models]
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0])  # k different initialisations
    losses = []
    for m in models:
        trainer.model.load_state_dict(m)
        losses.append(evaluate(trainer.model, trainer.ctx.train, trainer.ctx.task).loss)
    reply = trainer.on_fit({"models": models})
    want = min(range(2), key=lambda j: losses[j])
    assert reply["cluster"] == want and reply["metrics"]["cluster_loss"] == pytest.approx(losses[want])
    swapped = IFCATrainer(sim.contexts[0]).on_fit({"models": models[::-1]})
    assert swapped["cluster"] == 1 - want


def test_one_cluster_is_fedavg_bit_for_bit(tmp_path):
    over = {**OVER, "aggregator": {"clusters": 1, "weighting": "samples"}}
    ifca, a = tiny_run("ifca", tmp_path / "ifca", over)
    avg, b = tiny_run("fedavg", tmp_path / "avg", {**OVER, "aggregator": {}})
    for k, v in avg.server.global_state.items():
        assert torch.equal(ifca.server.models[0][k], v), k
    assert a["final"] == b["final"] and a["best"] == b["best"]
    # the upload also carries the cluster index (a few bytes more); everything else is the same
    # IFCA names no global model (its cluster models are the global ones), FedAvg does: compared without it
    drop = ("bytes_up", "global")
    assert records(tmp_path / "ifca", drop=drop) == records(tmp_path / "avg", drop=drop)
    uniform, _ = tiny_run("ifca", tmp_path / "u", {**OVER, "aggregator": {"clusters": 1}})
    avg_u, _ = tiny_run("fedavg", tmp_path / "avg_u", {**OVER, "aggregator": {"weighting": "uniform"}})
    assert all(torch.equal(uniform.server.models[0][k], v) for k, v in avg_u.server.global_state.items())


def test_k_models_travel_down_and_recovery_is_logged_on_a_clustered_dataset(tmp_path):
    sim, _ = tiny_run("ifca", tmp_path / "k2", CLUSTERED)
    one, _ = tiny_run("ifca", tmp_path / "k1", {**CLUSTERED, "aggregator": {"clusters": 1}})
    rec2, rec1 = records(tmp_path / "k2"), records(tmp_path / "k1")
    assert all(r2["bytes_down"] == 2 * r1["bytes_down"] for r1, r2 in zip(rec1, rec2))
    assert all(-1.0 <= r["ifca/ari"] <= 1.0 and r["ifca/assigned_clients"] == 4 for r in rec2)
    assert "ifca/ari" not in rec1[0]
    assigned = sim.server.assignments()
    assert sorted(assigned) == [0, 1, 2, 3] and set(assigned.values()) <= {0, 1}
    # without a known truth (a dirichlet partition) no ARI is logged
    tiny_run("ifca", tmp_path / "dir", OVER)
    assert all("ifca/ari" not in r and "ifca/clusters_used" in r for r in records(tmp_path / "dir"))


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("ifca", OVER, tmp_path)


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("ifca", CLUSTERED, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("aggregator.clusters=0",), "aggregator.clusters: 0 is invalid"),
    (("aggregator.clusters=9",), "aggregator.clusters: 9 cluster models for"),
    (("aggregator.weighting=median",), "aggregator.weighting"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("ifca", ("partition.num_clients=4",) + sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("ifca", CLUSTERED, tmp_path)
