"""Per-FedAvg: the trainer's local step is the paper's (FO and HF, against autograd's exact second derivatives),
alpha 0 is FedAvg bit for bit, evaluation is one step with alpha on a scratch copy, uniform mean, pooled = one trainer
per client, resume, two processes = serial, bad input."""
import os

import pytest
import torch
from easydict import EasyDict
from torch import nn

from pflkit.core import AdaptationSettings, ClientContext, SplitModel, TensorData, classification, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records as records,
                                 run_capturing_replies, tiny_config, tiny_simulation)
from pflkit_perfedavg import PerFedAvgTrainer

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def simulation(tmp_path, name, algorithm="perfedavg", sets=(), **kw):
    return tiny_simulation(algorithm, tmp_path / name, OVER, sets, **kw)


# -- one client against autograd ------------------------------------------------------------------------------
def small_model():
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3), 5)


def client(variant, alpha=0.3, beta=0.2, adaptation=None):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    # batch_size = all 12 samples: D, D' and D'' are the whole split, so the step has a closed form
    ctx = ClientContext(cid=0, train=TensorData(x, y), test=TensorData(x, y), task=classification(3),
                        device=torch.device("cpu"),
                        hp=EasyDict(variant=variant, alpha=alpha, beta=beta, delta=1e-4, bn_stats="shared"),
                        train_cfg=EasyDict(optimizer="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, batch_size=12,
                                           local_epochs=1, eval_batch_size=64),
                        build_model=lambda: small_model().double(), num_clients=1, seed=0, adaptation=adaptation)
    ctx.generator.manual_seed(11)
    return PerFedAvgTrainer(ctx)


def test_local_step_matches_the_papers_update_computed_by_autograd():
    for variant in ("fo", "hf"):
        alpha, beta = 0.3, 0.2
        trainer = client(variant, alpha, beta)
        model = small_model().double()
        names = [n for n, _ in model.named_parameters()]
        x, y = trainer.ctx.train.all()

        def f(ps):
            out = torch.func.functional_call(model, dict(zip(names, ps)), (x,))
            return nn.functional.cross_entropy(out, y)

        w = [p.detach().clone().requires_grad_() for p in model.parameters()]
        g = torch.autograd.grad(f(w), w)
        w_tilde = [(wi - alpha * gi).detach().requires_grad_() for wi, gi in zip(w, g)]
        outer = torch.autograd.grad(f(w_tilde), w_tilde)
        direction = list(outer)
        if variant == "hf":  # exact H(w) v by double back-propagation
            gw = torch.autograd.grad(f(w), w, create_graph=True)
            hv = torch.autograd.grad(gw, w, grad_outputs=outer)
            direction = [o - alpha * h for o, h in zip(outer, hv)]
        want = [wi.detach() - beta * d for wi, d in zip(w, direction)]
        trainer.local_update()  # one local step: one batch of 12
        got = [p.detach() for p in trainer.model.parameters()]
        tol = 1e-6 if variant == "hf" else 1e-12  # HF: central differences with delta 1e-4
        assert all(torch.allclose(a, b, atol=tol, rtol=0) for a, b in zip(got, want)), variant
        fo_only = [wi.detach() - beta * o for wi, o in zip(w, outer)]
        if variant == "hf":  # the Hessian term is really there
            assert not all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(got, fo_only))


def test_evaluation_scores_one_step_with_alpha_on_a_copy():
    adapt = AdaptationSettings("every", steps=1, epochs=None, lr=None, params="all")
    trainer = client("fo", alpha=0.4, adaptation=adapt)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    reply = trainer.on_evaluate({})
    assert same_state(trainer.model.state_dict(), before) and reply["adapt_steps"] == 1
    # by hand: one SGD step with alpha on the (whole-split) batch, then score
    model = small_model().double()
    x, y = trainer.ctx.train.all()
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.4 * p.grad
    want = trainer.evaluate_model(model)
    assert reply["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-12)
    assert reply["metric_sum"] == want["metric_sum"]


# -- whole runs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_alpha_zero_is_fedavg_bit_for_bit(tmp_path, variant):
    per = simulation(tmp_path, "per", sets=("trainer.alpha=0", f"trainer.variant={variant}", "eval.adapt=never",
                                            "aggregator.weighting=samples"))
    got = run_capturing_replies(per)
    avg = simulation(tmp_path, "avg", "fedavg")
    want = run_capturing_replies(avg)
    assert records(tmp_path / "per") == records(tmp_path / "avg")
    for rnd in want:
        for cid in want[rnd]:
            assert same_state(got[rnd][cid]["params"], want[rnd][cid]["params"])
            assert got[rnd][cid]["train_loss"] == want[rnd][cid]["train_loss"]


def test_defaults_uniform_mean_and_one_step_evaluation(tmp_path):
    cfg = tiny_config("perfedavg")
    assert cfg.aggregator.weighting == "uniform"
    assert (cfg.eval.adapt, cfg.eval.adapt_steps, cfg.eval.adapt_epochs) == ("every", 1, None)
    sim = simulation(tmp_path, "run")
    up = run_capturing_replies(sim)
    last = max(up)
    states = [up[last][c]["params"] for c in sorted(up[last])]
    for k, v in sim.server.global_state.items():  # the plain mean of the uploads, whatever the sample counts
        assert torch.allclose(v.double(), sum(s[k].double() for s in states) / len(states), atol=1e-6)
    for rec in records(tmp_path / "run"):
        assert rec["adapt/steps"] == 4 and rec["adapt/clients"] == 4  # one step per client per evaluation


def test_pooled_equals_one_trainer_per_client(tmp_path):
    assert_pooled_matches_one_trainer_per_client("perfedavg", OVER, tmp_path, ("trainer.variant=hf",))


def test_resume_reaches_the_same_numbers(tmp_path):
    assert_resume_matches_full_run("perfedavg", OVER, tmp_path)


@pytest.mark.parametrize("sets, message", [
    (("trainer.alpha=-0.1",), "trainer.alpha: -0.1 is invalid: must be >= 0"),
    (("trainer.beta=0",), "trainer.beta: 0.0 is invalid: must be > 0"),
    (("trainer.delta=0",), "trainer.delta: 0.0 is invalid: must be > 0"),
    (("trainer.variant=so",), "trainer.variant: 'so' is not one of 'fo', 'hf'"),
    (("eval.adapt_epochs=1",), "eval.adapt_steps (1) and eval.adapt_epochs (1) are both set"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("perfedavg", sets, message, tmp_path, strict=True)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("perfedavg", OVER, tmp_path, ("trainer.variant=hf",))
