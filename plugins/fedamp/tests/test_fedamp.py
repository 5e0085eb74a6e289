"""FedAMP: the equations on hand-made tensors, the server's cloud models on hand-made uploads, the proximal term's
gradient, the documented reductions to Local, pooled = one trainer per client, resume (and a spilling server store)
= the full run, bad input, and --workers 2 = serial (slow)."""
import os

import pytest
import torch

from pflkit.core import Simulation, same_state
from pflkit.core.testing import (assert_pooled_matches_one_trainer_per_client, assert_resume_matches_full_run,
                                 assert_run_refused, assert_workers_match_serial, metrics_records, tiny_config,
                                 tiny_run)
from pflkit_fedamp import (FedAMPTrainer, cloud_model, cosine_attention, exp_attention, prox_coefficient,
                           self_weight)
from pflkit_fedamp.equations import cosine, dot, squared_distance

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


def run(tmp_path, name, algorithm="fedamp", sets=(), over=OVER, **kw):
    return tiny_run(algorithm, tmp_path / name, over, sets, **kw)


# -- the equations --------------------------------------------------------------------------------------------
def test_attention_and_cloud_model_on_hand_made_tensors():
    d = torch.tensor([0.0, 2.0], dtype=torch.float64)
    xi = exp_attention(d, alpha_k=0.5, sigma=2.0)  # (0.5 / 2) exp(-d / 2)
    assert torch.allclose(xi, torch.tensor([0.25, 0.25 * torch.exp(torch.tensor(-1.0)).item()], dtype=torch.float64))
    assert self_weight(xi) == pytest.approx(1 - 0.25 - 0.25 * 0.36787944117)
    assert self_weight(torch.zeros(0)) == 1.0
    cos = torch.tensor([1.0, 0.0], dtype=torch.float64)
    xc = cosine_attention(cos, sigma=2.0, xi_ii=0.2)  # 0.8 * softmax([2, 0])
    e2 = torch.exp(torch.tensor(2.0, dtype=torch.float64))
    assert torch.allclose(xc, 0.8 * torch.tensor([e2 / (e2 + 1), 1 / (e2 + 1)], dtype=torch.float64))
    assert self_weight(xc) == pytest.approx(0.2)
    own = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)}
    others = [{"w": torch.tensor([3.0, 0.0]), "n": torch.tensor(1)}, {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(2)}]
    u = cloud_model(own, 0.5, others, [0.25, 0.25])
    assert torch.allclose(u["w"], torch.tensor([0.5 + 0.75, 1.0 + 1.0])) and int(u["n"]) == 7  # counters stay w_i's
    same = cloud_model(own, 1.0, others, [0.0, 0.0])  # xi_ii = 1: exactly w_i
    assert torch.equal(same["w"], own["w"])
    assert prox_coefficient(1.0, 0.25) == 2.0 and prox_coefficient(0.0, 0.0) == 0.0
    assert prox_coefficient(1.0, 0.0) == float("inf")
    a, b = [torch.tensor([3.0, 0.0]), torch.tensor([1.0])], [torch.tensor([0.0, 4.0]), torch.tensor([0.0])]
    assert squared_distance(a, b) == 26.0 and dot(a, a) == 10.0 and cosine(a, b) == 0.0
    assert cosine(a, a) == pytest.approx(1.0) and cosine(a, [torch.zeros(2), torch.zeros(1)]) == 0.0


def test_the_proximal_term_has_its_gradient(tmp_path):
    """Unlike PFLlib's client since 2023, the pull toward u_i moves w: d/dw c ||w - u||^2 = 2 c (w - u)."""
    sim = Simulation(tiny_config("fedamp", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = FedAMPTrainer(sim.contexts[0])
    x, y = sim.contexts[0].train.x[:8], sim.contexts[0].train.y[:8]
    trainer._anchor = [p.detach() + 0.5 for p in trainer._params]  # u = w + 0.5
    trainer._coef = 3.0

    def grads(fn):
        trainer.model.zero_grad()
        fn().backward()
        return [p.grad.clone() for p in trainer._params]

    with_prox = grads(lambda: trainer.loss(x, y))
    data_only = grads(lambda: trainer.data_loss(trainer.model, x, y))
    for g, g0 in zip(with_prox, data_only):
        assert torch.allclose(g - g0, torch.full_like(g, 2 * 3.0 * -0.5), atol=1e-5)


def test_the_server_sends_each_client_its_cloud_model(tmp_path):
    """Hand-made uploads in the store: u_i from the exp attention, the self weight, a stale peer, and a client that
    never uploaded (it holds the initial model and is nobody's peer)."""
    cfg = tiny_config("fedamp", OVER, ("aggregator.attention=exp", "aggregator.alpha_k=0.1",
                                       "aggregator.sigma=10", "aggregator.lam=0.4"))
    server = Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False).server
    w0 = server.initial
    ups = {c: {k: (v + 0.01 * (c + 1) if v.is_floating_point() else v) for k, v in w0.items()} for c in (0, 1, 2)}
    for c, s in ups.items():
        server.models.put(c, s)
    msgs = server.configure_fit(1, [0, 3])
    flat = {c: torch.cat([s[k].reshape(-1).double() for k in server.param_keys]) for c, s in {**ups, 3: w0}.items()}
    for i in (0, 3):
        js = [j for j in (0, 1, 2) if j != i]
        d = torch.tensor([float((flat[i] - flat[j]).square().sum()) for j in js], dtype=torch.float64)
        xi = 0.1 / 10 * torch.exp(-d / 10)
        want = cloud_model(ups.get(i, w0), 1 - float(xi.sum()), [ups[j] for j in js], [float(x) for x in xi])
        got = msgs[i].payload["cloud"]
        assert all(torch.allclose(got[k].float(), want[k].float(), atol=1e-6) for k in want), i
        assert msgs[i].payload["prox"] == pytest.approx(0.4 / (2 * 0.1))
    # peers=round: only this round's selected clients that have uploaded
    server.ctx.hp.peers = "round"
    alone = server.configure_fit(1, [0, 3])[0].payload["cloud"]
    assert all(torch.equal(alone[k], ups[0][k]) for k in ups[0])  # 3 has not uploaded: 0 has no peer


# -- the documented reductions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets", [
    ("aggregator.attention=exp", "aggregator.alpha_k=0", "aggregator.lam=0"),
    ("aggregator.attention=cosine", "aggregator.self_weight=1", "aggregator.lam=0"),
])
def test_without_message_passing_or_pull_fedamp_is_local_bit_for_bit(tmp_path, sets):
    """alpha_k = 0 switches the exp attention off (xi_ij = 0, so u_i = w_i); the proximal weight lambda / (2 alpha_k)
    is then infinite unless lambda = 0 (refused below), and with lambda = 0 every client trains alone: Local. Under
    cosine attention alpha_k only scales the pull, so self_weight = 1 (u_i = w_i) with lambda = 0 is the same."""
    run(tmp_path, "amp", sets=sets)
    run(tmp_path, "local", "local")
    drop = ("fedamp/", "bytes")
    assert metrics_records(tmp_path / "amp", drop) == metrics_records(tmp_path / "local", drop)
    run(tmp_path, "default")
    assert metrics_records(tmp_path / "default", drop) != metrics_records(tmp_path / "local", drop)


# -- state ---------------------------------------------------------------------------------------------------------
def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, legacy = assert_pooled_matches_one_trainer_per_client("fedamp", OVER, tmp_path)
    for cid in pooled.client_ids:
        want, got = legacy.backend.trainers[cid].state_dict(), pooled.backend.trainers[cid].state_dict()
        assert sorted(got) == sorted(want) and all(same_state(got[p], want[p]) for p in want), cid


@pytest.mark.parametrize("budget", [None, 0])
def test_resume_reaches_the_same_numbers(tmp_path, budget):
    assert_resume_matches_full_run("fedamp", {**OVER, "server": {"state_memory": budget}}, tmp_path)


def test_a_server_budget_spills_the_uploads_with_the_same_numbers(tmp_path):
    free, a = run(tmp_path, "free")
    tight, b = run(tmp_path, "tight", sets=("server.state_memory=0",))
    assert tight.server_stores.spilled == len(tight.server.models) > 0 and free.server_stores.spilled == 0
    assert metrics_records(tmp_path / "free") == metrics_records(tmp_path / "tight") and a["final"] == b["final"]
    # down: one cloud model per selected client; up: one model -- the same volume
    rec = metrics_records(tmp_path / "free")[0]
    assert rec["bytes_down"] == pytest.approx(rec["bytes_up"], rel=0.01)


@pytest.mark.parametrize("sets, message", [
    (("aggregator.lam=-1",), "aggregator.lam: -1.0 is invalid"),
    (("aggregator.alpha_k=-0.5",), "aggregator.alpha_k: -0.5 is invalid"),
    (("aggregator.self_weight=2",), "aggregator.self_weight: 2.0 is invalid: must lie in [0, 1]"),
    (("aggregator.attention=dot",), "aggregator.attention: 'dot' is not one of"),
    (("aggregator.alpha_k=0",), "aggregator.alpha_k: 0 with aggregator.lam 1 makes the client's proximal weight"),
    (("aggregator.attention=exp", "aggregator.sigma=0"), "aggregator.sigma: 0 is invalid with attention exp"),
    (("trainer.start=middle",), "trainer.start: 'middle' is not one of"),
    (("server.state_memory=lots",), "server.state_memory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    assert_run_refused("fedamp", sets, message, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    assert_workers_match_serial("fedamp", {**OVER, "server": {"state_memory": 0}}, tmp_path)
