"""Network Lasso: the ADMM updates on hand-made tensors, the graph and the cluster score, lambda = 0 (decoupled
clients: Local with the proximal-point step), lambda large (everything fused), the server store, pooled = one
trainer per client, resume, bad input, and --workers 2 = serial (slow)."""
import os

import pytest
import torch

from pflkit.core import Simulation
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records, tiny_config,
                                 tiny_run)
from pflkit_netlasso import NetLassoTrainer, flat_params
from pflkit_netlasso.equations import (edge_step, fused_components, objective_penalty, prox_center, u_update,
                                       z_update)
from pflkit_netlasso.graph import complete_graph, degrees, knn_graph
from pflkit_netlasso.recovery import adjusted_rand_index

OVER = {"rounds": 3}


def run(tmp_path, name, sets=(), over=OVER, algorithm="netlasso", **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- the equations -----------------------------------------------------------------------------------------------
def test_z_update_is_the_group_soft_threshold_of_sec_3_2():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])  # ||a - b|| = 5
    z_jk, z_kj, theta = z_update(a, b, 1.0)  # theta = 1 - 1/5
    assert theta == pytest.approx(0.8)
    assert torch.allclose(z_jk, torch.tensor([2.4, 0.8])) and torch.allclose(z_kj, torch.tensor([0.6, 3.2]))
    assert torch.allclose(z_jk + z_kj, a + b)  # the midpoint stays; the difference shrinks by 2 * threshold
    assert float(torch.linalg.vector_norm(z_jk - z_kj)) == pytest.approx(5.0 - 2.0)
    z_jk, z_kj, theta = z_update(a, b, 2.5)  # at ||a - b|| <= 2 threshold the edge is fused at the midpoint
    assert theta == 0.5 and torch.equal(z_jk, z_kj) and torch.allclose(z_jk, torch.tensor([1.5, 2.0]))
    z_jk, z_kj, theta = z_update(a, b, 0.0)  # no penalty: z = (a, b) exactly
    assert theta == 1.0 and torch.equal(z_jk, a) and torch.equal(z_kj, b)
    z_jk, z_kj, theta = z_update(a, a.clone(), 1.0)  # a = b: fused, no 0/0
    assert theta == 0.5 and torch.equal(z_jk, a) and torch.equal(z_kj, a)


def test_z_update_minimises_the_edge_subproblem():
    """lambda w ||z1 - z2|| + rho/2 (||a - z1||^2 + ||b - z2||^2) (Sec. 3.1's z-update) is smallest at Sec. 3.2's
    closed form: no random perturbation lowers it."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    for lam_w, rho in ((0.3, 1.0), (5.0, 1.0), (0.7, 0.2)):
        def objective(z1, z2):
            return lam_w * float(torch.linalg.vector_norm(z1 - z2)) + rho / 2 * float(
                (a - z1).square().sum() + (b - z2).square().sum())

        z1, z2, _ = z_update(a, b, lam_w / rho)
        best = objective(z1, z2)
        for _ in range(200):
            d1 = 1e-3 * torch.randn(6, generator=gen, dtype=torch.float64)
            d2 = 1e-3 * torch.randn(6, generator=gen, dtype=torch.float64)
            assert objective(z1 + d1, z2 + d2) >= best - 1e-12


def test_u_update_and_the_antisymmetric_dual():
    x_j, x_k, u = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -2.0]), torch.tensor([0.5, 0.25])
    a, b = x_j + u, x_k - u
    z_jk, z_kj, _ = z_update(a, b, 1.0)
    u_jk, u_kj = u_update(a, b, z_jk, z_kj)
    assert torch.allclose(u_jk, u + x_j - z_jk) and torch.allclose(u_kj, -u + x_k - z_kj)  # u + x - z
    assert torch.allclose(u_jk + u_kj, torch.zeros(2), atol=1e-6)  # so one dual per edge is kept: u_kj = -u_jk
    new_u, c_j, c_k, theta, gap, dist = edge_step(x_j, x_k, u, 1.0)
    assert torch.equal(new_u, u_jk) and torch.allclose(c_j, z_jk - u_jk) and torch.allclose(c_k, z_kj - u_kj)
    assert dist == pytest.approx(float(torch.linalg.vector_norm(a - b)))
    assert gap == pytest.approx(float(torch.linalg.vector_norm(z_jk - z_kj)))


def test_x_update_prox_is_the_sum_of_the_edge_terms():
    """sum_k (rho/2)||x - c_k||^2 and (rho d/2)||x - mean c||^2 have the same gradient (Sec. 3.1's x-update as one
    proximal term); the running mean of equal centres is exactly that centre."""
    rho = 0.3
    centres = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 3.0, -1.0])]
    x = torch.tensor([0.2, 0.4, -0.6], requires_grad=True)
    sum(rho / 2 * (x - c).square().sum() for c in centres).backward()
    per_edge = x.grad.clone()
    x.grad = None
    mean, d = prox_center(centres)
    assert d == 3 and torch.allclose(mean, torch.stack(centres).mean(0))
    (rho * d / 2 * (x - mean).square().sum()).backward()
    assert torch.allclose(x.grad, per_edge)
    c = torch.tensor([0.1, 0.7, 1.3])
    assert torch.equal(prox_center([c, c.clone(), c.clone()])[0], c)
    assert prox_center([]) == (None, 0)


def test_graphs_components_and_adjusted_rand_index():
    assert complete_graph(3) == [(0, 1, 1.0), (0, 2, 1.0), (1, 2, 1.0)]
    xs = [torch.tensor([0.0]), torch.tensor([5.0]), torch.tensor([9.0]), torch.tensor([10.0])]
    assert knn_graph(xs, 1) == [(0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0)]  # 0 chose 1, 1 chose 2, 2 and 3 each other
    assert degrees(4, knn_graph(xs, 1)) == [1, 2, 2, 1]
    assert objective_penalty(xs, [(0, 1, 1.0), (2, 3, 0.5)], 2.0) == pytest.approx(2.0 * (5.0 + 0.5 * 1.0))
    assert fused_components(5, [(3, 4), (0, 2)]) == [0, 1, 0, 2, 2]
    assert adjusted_rand_index([0, 0, 1, 1], [5, 5, 2, 2]) == 1.0  # up to renaming
    assert adjusted_rand_index([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(-0.5)  # worse than chance


# -- the degenerate cases ----------------------------------------------------------------------------------------
class OwnProxTrainer(NetLassoTrainer):
    """Local training with the proximal-point step (rho d / 2)||x - x_i^t||^2 around the client's own model: what
    lambda = 0 must reduce to. Uploads nothing (protocol local)."""

    protocol = "local"
    declares_state = True
    weight = 0.2 * 3  # rho * degree on the tiny config's complete graph of 4 clients

    def on_fit(self, payload):
        reply = super().on_fit({"centre": flat_params(self.model), "weight": self.weight})
        return {"num_samples": reply["num_samples"], "train_loss": reply["train_loss"]}


def test_lambda_zero_decouples_the_clients_into_local_proximal_point_steps(tmp_path, registries_snapshot):
    """At lambda = 0 every z-update is z = (x + u) exactly, so u stays 0 and each client's centre is its own last
    model, bit for bit: Network Lasso is then Local training with a proximal pull to the client's own previous
    model (the proximal-point method on f_i; Local itself at rho -> 0)."""
    registries_snapshot.TRAINERS.register("netlasso_test_ownprox", OwnProxTrainer)
    nl, _ = run(tmp_path, "nl", ("aggregator.lam=0", "aggregator.rho=0.2"))
    for cid in range(4):
        assert torch.equal(nl.server.centres.get(cid), nl.server.models.get(cid))
        assert not nl.server.duals.get(cid, torch.zeros(1)).any()
    ref, _ = run(tmp_path, "own", ("trainer.name=netlasso_test_ownprox",), algorithm="local")
    drop = ("bytes", "netlasso")
    assert metrics_records(tmp_path / "nl", drop) == metrics_records(tmp_path / "own", drop)
    local, _ = run(tmp_path, "local", algorithm="local")  # the proximal pull is there: not Local itself
    assert metrics_records(tmp_path / "local", drop) != metrics_records(tmp_path / "nl", drop)


def test_knn_round_one_is_local_training(tmp_path):
    """graph=knn: round 1 has no edges (weight 0, no centre sent), which is Local's round bit for bit; the graph
    is then built from the uploads."""
    nl, _ = run(tmp_path, "nl", ("aggregator.graph=knn", "aggregator.graph_k=1"), over={"rounds": 1})
    run(tmp_path, "local", algorithm="local", over={"rounds": 1})
    drop = ("bytes", "netlasso")
    assert metrics_records(tmp_path / "nl", drop) == metrics_records(tmp_path / "local", drop)
    xs = [nl.server.models.get(i) for i in range(4)]
    assert nl.server.edges == knn_graph(xs, 1) and nl.server.edges


def test_a_large_lambda_fuses_every_edge_and_a_tiny_one_none(tmp_path):
    big, _ = run(tmp_path, "big", ("aggregator.lam=100",))
    assert big.server.report["fused_edges"] == 1.0 and big.server.report["clusters"] == 1.0
    assert big.server.labels == [0, 0, 0, 0]
    small, _ = run(tmp_path, "small", ("aggregator.lam=1e-6",))
    assert small.server.report["fused_edges"] == 0.0 and small.server.labels == [0, 1, 2, 3]
    rec = metrics_records(tmp_path / "small")[-1]
    assert rec["netlasso/clusters"] == 4.0 and rec["netlasso/mean_theta"] > 0.99


def test_cluster_recovery_is_scored_against_the_true_clusters(tmp_path):
    over = {"rounds": 2, "dataset": {"name": "digits_clusters", "num_clusters": 2, "clients_per_cluster": 2},
            "partition": {"name": "by_group", "num_clients": 4}}
    sim, _ = run(tmp_path, "cl", ("aggregator.lam=100",), over=over)
    assert sim.server.truth == [0, 0, 1, 1] and sim.server.labels == [0, 0, 0, 0]
    rec = metrics_records(tmp_path / "cl")[-1]
    assert rec["netlasso/ari"] == adjusted_rand_index([0, 0, 1, 1], [0, 0, 0, 0]) == 0.0
    plain, _ = run(tmp_path, "plain")  # no true clusters: no score
    assert plain.server.truth is None and "netlasso/ari" not in metrics_records(tmp_path / "plain")[-1]


def test_the_client_trains_toward_its_centre(tmp_path):
    sim = Simulation(tiny_config("netlasso", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = NetLassoTrainer(sim.contexts[0])
    start = flat_params(trainer.model)
    far = start + 3.0
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    free = trainer.on_fit({"weight": 0.0})["params"]
    trainer.model.load_state_dict(state)
    pulled = trainer.on_fit({"centre": far, "weight": 5.0})["params"]
    assert torch.linalg.vector_norm(pulled - far) < torch.linalg.vector_norm(free - far)
    with pytest.raises(ValueError, match="flat vector"):
        trainer.on_fit({"centre": far[:-1], "weight": 5.0})


# -- state -------------------------------------------------------------------------------------------------------
def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("netlasso", {**OVER, "participation": {"join_ratio": 0.5}},
                                                  tmp_path)


def test_edge_variables_live_in_the_server_store_and_spill_without_changing_a_number(tmp_path):
    """x_i, the centres and the duals are in the core's server store: under server.state_memory = 0 every entry
    goes to disk, and the run computes the same numbers; a resume restores them under a tight budget too."""
    over = {**OVER, "participation": {"join_ratio": 0.5}}
    free, _ = run(tmp_path, "free", over=over)
    tight, _ = run(tmp_path, "tight", over={**over, "server": {"state_memory": 0}})
    assert free.server_stores.spilled == 0 and free.server_stores.memory_bytes > 0
    assert tight.server_stores.memory_bytes == 0 and tight.server_stores.spilled == 4 + 4 + 3  # x, centre, duals
    assert metrics_records(tmp_path / "free") == metrics_records(tmp_path / "tight")
    assert len(free.server.duals.get(0)) == 3 and free.server.duals.get(3) is None  # edges (0,k) k > 0; none for 3
    assert_resume_matches_full_run("netlasso", {**over, "server": {"state_memory": 0}}, tmp_path / "resume",
                                   stop_after=1)


@pytest.mark.parametrize("sets", [(), ("aggregator.graph=knn", "aggregator.graph_k=1")])
def test_resume_reaches_the_same_numbers(tmp_path, sets):
    assert_resume_matches_full_run("netlasso", {**OVER, "participation": {"join_ratio": 0.5}}, tmp_path, sets,
                                   stop_after=1)


@pytest.mark.parametrize("sets, message", [
    (("aggregator.lam=-1",), "aggregator.lam: -1.0 is invalid: must be >= 0"),
    (("aggregator.rho=0",), "aggregator.rho: 0.0 is invalid: must be > 0"),
    (("aggregator.graph=star",), "aggregator.graph: 'star' is not one of"),
    (("aggregator.graph_k=0",), "aggregator.graph_k: 0 is invalid: must be > 0"),
    (("aggregator.fuse_tol=-0.5",), "aggregator.fuse_tol: -0.5 is invalid: must be >= 0"),
    (("aggregator.name=fedavg",), "protocol"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("netlasso", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("netlasso", {**OVER, "participation": {"join_ratio": 0.5}}, tmp_path)
