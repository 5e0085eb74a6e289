"""APFL: the mixture and alpha update on hand-made tensors, v trained through the mixture, alpha 0 = FedAvg's
global model bit for bit, pooled = one trainer per client, resume, bad input, --workers 2 = serial (slow)."""
import os

import pytest
import torch
from torch.func import functional_call

from pflkit.core import Simulation, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 tiny_config, tiny_run)
from pflkit_apfl import APFLTrainer, alpha_grad, alpha_step, mix

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def run(tmp_path, name, algorithm="apfl", sets=(), **kw):
    return tiny_run(algorithm, tmp_path / name, OVER, sets, **kw)


def test_mixture_and_alpha_update_on_hand_made_tensors():
    v, w = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    assert torch.allclose(mix(v, w, 0.25), torch.tensor([2.5, -1.0]))
    assert torch.equal(mix(v, w, 0.0), w) and torch.equal(mix(v, w, 1.0), v)
    g = torch.tensor([0.5, 1.0])
    assert float(alpha_grad([v], [w], [g])) == pytest.approx(-2 * 0.5 + 4 * 1.0)  # <v - w, g> = 3
    assert alpha_step(0.5, 3.0, 0.1) == pytest.approx(0.2)
    assert alpha_step(0.5, 10.0, 0.1) == 0.0 and alpha_step(0.5, -10.0, 0.1) == 1.0  # projected on [0, 1]


def test_autograd_through_the_mixture_gives_alpha_times_the_mixed_gradient_and_the_alpha_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    v = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    w = {n: p.detach().clone() + torch.randn_like(p) for n, p in layer.named_parameters()}
    alpha = torch.tensor(0.3, requires_grad=True)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    mixed = {n: mix(v[n], w[n], alpha) for n in v}
    torch.nn.functional.cross_entropy(functional_call(layer, mixed, (x,)), y).backward()
    plain = {n: t.detach().clone().requires_grad_(True) for n, t in mixed.items()}
    torch.nn.functional.cross_entropy(functional_call(layer, plain, (x,)), y).backward()
    for n in v:  # grad_v f(v_bar) = alpha grad f(v_bar)
        assert torch.allclose(v[n].grad, 0.3 * plain[n].grad)
    expected = alpha_grad([v[n].detach() for n in v], [w[n] for n in v], [plain[n].grad for n in v])
    assert abs(float(expected)) > 1e-3 and torch.allclose(alpha.grad, expected)


def test_alpha_zero_is_fedavgs_global_model_bit_for_bit(tmp_path):
    apfl, a = run(tmp_path, "apfl", sets=("trainer.alpha=0", "trainer.adaptive=false"))
    avg, b = run(tmp_path, "avg", "fedavg")
    for k, v in avg.server.global_state.items():
        assert torch.equal(apfl.server.global_state[k], v), k
    # the mixture 0 v + 1 w is w itself: the same evaluation; only APFL's two metrics (and their bytes) differ
    assert a["final"] == b["final"] and a["best"] == b["best"]
    # the global model's scores are FedAvg's too; only how they were got differs (APFL evaluates w on its own)
    assert records(tmp_path / "apfl", drop=("alpha", "mixed_loss", "bytes_up", "global_reused")) == \
        records(tmp_path / "avg", drop=("bytes_up", "global_reused"))
    default, _ = run(tmp_path, "default")
    assert all(torch.equal(default.server.global_state[k], v) for k, v in avg.server.global_state.items())
    assert records(tmp_path / "default", drop=("alpha", "mixed_loss", "bytes_up")) != \
        records(tmp_path / "avg", drop=("bytes_up",))  # w is FedAvg's whatever alpha; the scored model is not


def test_v_learns_through_the_mixture_and_alpha_adapts(tmp_path):
    sim = Simulation(tiny_config("apfl", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = APFLTrainer(sim.contexts[1])
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    v0 = {k: t.clone() for k, t in trainer.local.state_dict().items()}
    reply = trainer.on_fit({"params": w_t})
    assert any(not torch.equal(trainer.local.state_dict()[k], v0[k]) for k in v0)
    assert reply["metrics"]["alpha"] == trainer.alpha != 0.5
    fixed = APFLTrainer(sim.contexts[1])
    fixed.ctx.hp = type(fixed.ctx.hp)({**fixed.ctx.hp, "adaptive": False})
    fixed.on_fit({"params": w_t})
    assert fixed.alpha == 0.5
    # the scored model is alpha v + (1 - alpha) w with the w of the evaluate message
    trainer.on_evaluate({"params": w_t})
    for n, p in trainer.mixed.named_parameters():
        assert torch.allclose(p, trainer.alpha * trainer.local.state_dict()[n] + (1 - trainer.alpha) * w_t[n])


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("apfl", OVER, tmp_path)
    for cid in pooled.client_ids:
        want, got = legacy.backend.trainers[cid].state_dict(), pooled.backend.trainers[cid].state_dict()
        assert sorted(got) == sorted(want) and want["alpha"] == got["alpha"], cid
        assert same_state(got["local"], want["local"]) and same_state(got["model"], want["model"]), cid


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("apfl", OVER, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.alpha=1.5",), "trainer.alpha: 1.5 is invalid"),
    (("trainer.alpha_lr=0",), "trainer.alpha_lr: 0.0 is invalid: must be > 0"),
    (("trainer.adaptive=maybe",), "trainer.adaptive"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("apfl", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("apfl", OVER, tmp_path)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("apfl", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
