"""pFedMe: the update rules on hand-made tensors, the beta = 1 / one-inner-step reduction, evaluation of theta,
pooled = one trainer per client, resume, the fast path, bad input, and --workers 2 = serial (slow)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from pflkit.core import Simulation, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, tiny_config, tiny_run)
from pflkit_pfedme import PFedMeTrainer, beta_mix, inner_step, local_w_step

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def run(tmp_path, name, algorithm="pfedme", sets=(), over=OVER, **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- the equations --------------------------------------------------------------------------------------------
def test_update_rules_on_hand_made_tensors():
    theta, grad, w = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 0.5])], [torch.tensor([0.0, 0.0])]
    # theta - 0.1 * (g + 2 (theta - w)) = [1 - 0.1 * 2.5, -2 - 0.1 * (-3.5)]
    assert torch.allclose(inner_step(theta, grad, w, 0.1, 2.0)[0], torch.tensor([0.75, -1.65]))
    # w - 0.5 * 2 * (w - theta) = theta when eta lambda = 1
    assert torch.allclose(local_w_step(w, theta, 0.5, 2.0)[0], theta[0])
    assert torch.allclose(local_w_step(w, theta, 0.1, 2.0)[0], torch.tensor([0.2, -0.4]))
    prev, mean = torch.tensor([1.0, 1.0]), torch.tensor([3.0, -1.0])
    assert beta_mix(prev, mean, 1.0) is mean
    assert torch.allclose(beta_mix(prev, mean, 0.5), torch.tensor([2.0, 0.0]))
    assert torch.allclose(beta_mix(prev, mean, 2.0), torch.tensor([5.0, -3.0]))  # the paper's beta = 2


def test_the_optimizer_step_on_the_personal_objective_is_the_inner_step():
    a, w = torch.tensor([0.3, -0.7]), torch.tensor([0.2, 0.1])
    theta = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = torch.optim.SGD([theta], lr=0.05)
    loss = (a * theta).sum() + 0.5 * 15.0 * (theta - w).square().sum()  # f with grad a, plus lambda/2 ||.||^2
    loss.backward()
    expected = inner_step([theta.detach().clone()], [a], [w], 0.05, 15.0)[0]
    opt.step()
    assert torch.allclose(theta.detach(), expected)


# -- the degenerate case ---------------------------------------------------------------------------------------
def test_beta_one_and_one_inner_step_from_w_is_fedavg_with_the_product_step_and_a_uniform_mean(tmp_path):
    """With K = 1 and the inner solve starting at w (inner_start=anchor), theta = w - eta_p grad f(w), so
    w - eta lambda (w - theta) = w - (eta lambda eta_p) grad f(w): local SGD with step eta * lambda * eta_p; beta = 1
    makes the server the plain uniform mean. pFedMe(lr 1, lambda 2, eta_p 0.025, K 1, anchor, beta 1) is therefore
    FedAvg(lr 0.05, weighting uniform), up to float rounding (the two orders of operations differ)."""
    pf, _ = run(tmp_path, "pfedme", sets=("train.lr=1.0", "trainer.lam=2", "trainer.personal_lr=0.025",
                                          "trainer.inner_steps=1", "trainer.inner_start=anchor",
                                          "aggregator.beta=1"))
    avg, _ = run(tmp_path, "avg", "fedavg", sets=("train.lr=0.05", "aggregator.weighting=uniform"))
    for k, v in avg.server.global_state.items():
        assert torch.allclose(pf.server.global_state[k], v, atol=1e-5), k
    samples, _ = run(tmp_path, "samples", "fedavg", sets=("train.lr=0.05",))  # the weighting matters here
    assert any(not torch.allclose(pf.server.global_state[k], v, atol=1e-5)
               for k, v in samples.server.global_state.items())
    # ... and the default (5 warm inner steps, lambda 15) is something else
    default, _ = run(tmp_path, "default")
    assert any(not torch.allclose(default.server.global_state[k], v, atol=1e-3)
               for k, v in avg.server.global_state.items())


def test_beta_mixes_the_mean_with_the_previous_global_model(tmp_path):
    sim = Simulation(tiny_config("pfedme", {"rounds": 1}, ("aggregator.beta=0.5",)), run_dir=tmp_path / "r",
                     tensorboard=False)
    server = sim.server
    before = {k: v.clone() for k, v in server.global_state.items()}
    ups = [{k: v + i for k, v in before.items()} for i in (1.0, 3.0)]
    server.aggregate_fit(1, {0: {"params": ups[0], "num_samples": 10}, 1: {"params": ups[1], "num_samples": 30}})
    for k, v in server.global_state.items():  # 0.5 w + 0.5 * (w + 2): uniform mean of +1 and +3, not 2.5
        assert torch.allclose(v, before[k] + 1.0), k


# -- what is evaluated -------------------------------------------------------------------------------------------
def test_evaluation_scores_the_personal_theta_and_w_before_any_training(tmp_path):
    sim = Simulation(tiny_config("pfedme", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = PFedMeTrainer(sim.contexts[1])
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    assert trainer.on_evaluate({"params": w_t}) == trainer.evaluate_model(trainer.model)  # no theta yet: w^t
    reply = trainer.on_fit({"params": w_t})
    assert trainer.has_personal and trainer.personal_forward() is trainer.personal
    scored = trainer.on_evaluate({"params": w_t})
    assert scored == trainer.evaluate_model(trainer.personal)
    assert scored != trainer.evaluate_model(trainer.model)  # theta is not the global w^t it was scored against
    theta = trainer.personal.state_dict()
    assert any(not torch.equal(theta[k], reply["params"][k]) for k in theta)  # and theta is not the upload either


# -- state -------------------------------------------------------------------------------------------------------
def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("pfedme", OVER, tmp_path)
    for cid in pooled.client_ids:
        want, got = legacy.backend.trainers[cid].state_dict(), pooled.backend.trainers[cid].state_dict()
        assert sorted(got) == sorted(want) and all(same_state(got[p], want[p]) for p in want), cid


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("pfedme", OVER, tmp_path)


def test_fast_path_all_reduces_the_uniform_mean_before_beta(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from pflkit.core.testing import DistributedBackend

    over = {"rounds": 2, "aggregator": {"beta": 0.7}}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        fast, _ = run(tmp_path, "fast", over={**over, "distributed": {"exact": False}}, backend=DistributedBackend())
    finally:
        dist.destroy_process_group()
    serial, _ = run(tmp_path, "serial", over=over)
    for k, v in serial.server.global_state.items():
        assert torch.allclose(fast.server.global_state[k], v, atol=1e-5), k


@pytest.mark.parametrize("sets, message", [
    (("trainer.lam=-1",), "trainer.lam: -1.0 is invalid: must be > 0"),
    (("trainer.inner_steps=0",), "trainer.inner_steps: 0 is invalid: must be > 0"),
    (("trainer.personal_lr=0",), "trainer.personal_lr: 0.0 is invalid: must be > 0"),
    (("aggregator.beta=0",), "aggregator.beta: 0.0 is invalid: must be > 0"),
    (("trainer.inner_start=cold",), "trainer.inner_start: 'cold' is not one of"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("pfedme", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("pfedme", OVER, tmp_path)
