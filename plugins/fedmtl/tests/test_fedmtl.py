"""Fed-MTL: Omega's closed form and the fixed alternatives on hand-made matrices, the client's regulariser having
the gradient of tr(W Omega W^T) with respect to its column (PFLlib's, built from state_dict(), has none), the two
relays giving the same bits, lam = lam_fro = 0 = Local bit for bit, Omega learned from the stored models,
pooled = one trainer per client, resume (also with a spilling server store), bad input, --workers 2 = serial
(slow)."""
import os

import pytest
import torch

from pflkit.core import same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records, tiny_run)
from pflkit_fedmtl import (auto_lambda, client_regulariser, gram, neighbour_sums, omega_code, omega_initial,
                           omega_mean, sigma_and_omega, trace_regulariser)

OVER = {"rounds": 3, "partition": {"num_clients": 4}, "trainer": {"lam": 1e-3, "lam_fro": 1e-4}}


def run(tmp_path, name, algorithm="fedmtl", sets=(), over=OVER, **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- equations on hand-made matrices ----------------------------------------------------------------------------
def test_closed_form_omega_on_hand_made_matrices():
    w = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # orthogonal columns: W^T W = diag(9, 16)
    sigma, omega = sigma_and_omega(w.T @ w)
    assert torch.allclose(sigma, torch.diag(torch.tensor([3 / 7, 4 / 7], dtype=torch.float64)))
    assert torch.allclose(omega, torch.diag(torch.tensor([7 / 3, 7 / 4], dtype=torch.float64)))
    torch.manual_seed(0)
    w = torch.randn(6, 3, dtype=torch.float64)
    sigma, omega = sigma_and_omega(w.T @ w)
    nuclear = float(torch.linalg.svdvals(w).sum())  # tr((W^T W)^(1/2)) = ||W||_*
    assert float(torch.trace(sigma)) == pytest.approx(1.0)
    assert torch.allclose(sigma @ omega, torch.eye(3, dtype=torch.float64))
    assert torch.allclose(sigma @ sigma * nuclear ** 2, w.T @ w)  # Sigma = (W^T W)^(1/2) / ||W||_*
    # at the update, tr(W Omega W^T) is the squared trace norm of W
    assert float(torch.trace(w @ omega @ w.T)) == pytest.approx(nuclear ** 2)
    # a rank-deficient W (identical columns: every client at w^0) stays invertible through the eigenvalue floor
    same = torch.ones(4, 3, dtype=torch.float64)
    _, omega = sigma_and_omega(same.T @ same)
    assert torch.isfinite(omega).all()
    assert torch.equal(omega_initial(3), 3 * torch.eye(3, dtype=torch.float64))


def test_fixed_omegas_mean_and_the_reference_codes_constant():
    torch.manual_seed(1)
    w = torch.randn(5, 4, dtype=torch.float64)
    mean = w.mean(dim=1, keepdim=True)
    assert float(trace_regulariser(w, omega_mean(4), 1.0, 0.0)) == pytest.approx(float(((w - mean) ** 2).sum()))
    assert float(trace_regulariser(w, omega_code(4), 1.0, 0.0)) == \
        pytest.approx((1 - 1 / 4) ** 2 * float((w.sum(dim=1) ** 2).sum()))  # pulls the *sum* of the models to 0
    assert float(trace_regulariser(w, omega_mean(4), 0.0, 2.0)) == pytest.approx(2 * float((w ** 2).sum()))
    assert auto_lambda(582_026) == 1e-7 and auto_lambda(99) == 1e-3


def test_client_regulariser_has_the_gradient_of_the_trace_with_respect_to_its_column():
    torch.manual_seed(2)
    m, i, lam, lam_fro = 4, 2, 0.3, 0.05
    cols = [{"a": torch.randn(3, 2), "b": torch.randn(2)} for _ in range(m)]
    _, omega = sigma_and_omega(gram(cols, ["a", "b"]) + torch.eye(m, dtype=torch.float64))
    # the full objective over W (d x m), differentiated with respect to column i
    flat = torch.stack([torch.cat([c["a"].reshape(-1), c["b"]]) for c in cols], dim=1).double()
    flat.requires_grad_(True)
    trace_regulariser(flat, omega, lam, lam_fro).backward()
    want = flat.grad[:, i]
    # the client's part: live parameters of column i, b_i from the others
    live = {k: v.clone().requires_grad_(True) for k, v in cols[i].items()}
    b = neighbour_sums({i: omega[i].tolist()}, enumerate(cols), ["a", "b"])[i]
    client_regulariser(live, float(omega[i, i]), b, lam, lam_fro).backward()
    got = torch.cat([live["a"].grad.reshape(-1), live["b"].grad]).double()
    assert got.abs().sum() > 0 and torch.allclose(got, want, atol=1e-5)
    # PFLlib's FedMTL builds W from state_dict(): detached tensors, so its regulariser has no gradient at all
    model = torch.nn.Linear(2, 1)
    assert not any(t.requires_grad for t in model.state_dict().values())


# -- runs ------------------------------------------------------------------------------------------------------------
def test_both_relays_give_the_same_bits_and_count_their_downlink(tmp_path):
    combined, a = run(tmp_path, "combined")
    models, b = run(tmp_path, "models", sets=("aggregator.relay=models",))
    assert a["final"] == b["final"] and torch.equal(combined.server.omega, models.server.omega)
    ra, rb = metrics_records(tmp_path / "combined"), metrics_records(tmp_path / "models")
    assert [dict(r, bytes_down=0) for r in ra] == [dict(r, bytes_down=0) for r in rb]
    w_bytes = sum(v.numel() * v.element_size() for v in combined.server.initial.values())
    # combined: b_i (one model) + Omega_ii; models: the 3 other clients' parameters + Omega's row + Omega_ii
    assert ra[0]["bytes_down"] == 4 * (w_bytes + 8)
    assert rb[0]["bytes_down"] == 4 * (3 * w_bytes + 4 * 8 + 8)


def test_zero_weights_are_local_bit_for_bit(tmp_path):
    over = {**OVER, "trainer": {"lam": 0.0, "lam_fro": 0.0}}
    _, a = run(tmp_path, "mtl", over=over)
    _, b = run(tmp_path, "local", "local", over={"rounds": 3, "partition": {"num_clients": 4}})
    drop = ("bytes", "fedmtl/", "own_regulariser")  # Local sends and uploads nothing
    assert metrics_records(tmp_path / "mtl", drop=drop) == metrics_records(tmp_path / "local", drop=("bytes",))
    assert a["final"] == b["final"]
    _, c = run(tmp_path, "default")
    assert c["final"] != a["final"]  # the regulariser does change the models


def test_omega_is_learned_from_the_stored_models(tmp_path):
    sim, _ = run(tmp_path, "learned")
    cols = [sim.server.models.get(j) for j in range(4)]
    assert all(c is not None for c in cols)
    _, want = sigma_and_omega(gram(cols, sim.server.keys))
    assert torch.equal(sim.server.omega, want)
    fixed, _ = run(tmp_path, "mean", sets=("aggregator.omega=mean",))
    assert torch.equal(fixed.server.omega, omega_mean(4))
    every, _ = run(tmp_path, "every2", sets=("aggregator.omega_every=2",))  # last update after round 2
    assert not torch.equal(every.server.omega, sim.server.omega)


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("fedmtl", OVER, tmp_path)
    for cid in pooled.client_ids:
        assert same_state(pooled.backend.trainers[cid].state_dict(), legacy.backend.trainers[cid].state_dict())


@pytest.mark.parametrize("budget", [None, 0])
def test_resume_reaches_the_same_numbers(tmp_path, budget):
    assert_resume_matches_full_run("fedmtl", {**OVER, "server": {"state_memory": budget}}, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.lam=-1",), "trainer.lam: -1.0 is invalid: must be >= 0"),
    (("trainer.lam_fro=-0.5",), "trainer.lam_fro: -0.5 is invalid"),
    (("aggregator.omega=identity",), "aggregator.omega: 'identity' is not one of"),
    (("aggregator.omega_every=0",), "aggregator.omega_every: 0 is invalid: must be > 0"),
    (("aggregator.relay=some",), "aggregator.relay: 'some' is not one of"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedmtl", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedmtl", {**OVER, "server": {"state_memory": 0}}, tmp_path)
