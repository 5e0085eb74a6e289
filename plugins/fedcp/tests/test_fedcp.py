"""FedCP plugin tests: equations on known inputs, privacy of the personal head, frozen modules, end-to-end runs."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from easydict import EasyDict

from pflkit.core import ConfigError, Simulation, iter_tensors
from pflkit.core.testing import SerialBackend, quick_run, tiny_config
from pflkit_fedcp import ConditionalPolicyNetwork, FedCPAggregator, FedCPTrainer, client_vector, cpn_input, mmd_rbf


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster single-threaded (and do not fight parallel test processes for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RecordingBackend(SerialBackend):
    """Serial backend that keeps every (cid, message, reply) and the trainers for inspection."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, Any, Dict[str, Any], Dict[str, torch.Tensor]]] = []

    def execute(self, calls, snapshot=False):
        results = super().execute(calls, snapshot)
        for cid, res in results.items():
            trainer = self.trainers[cid]
            personal_head = {k: v.detach().clone() for k, v in trainer.model.head.state_dict().items()}
            self.log.append((cid, calls[cid].message, res.reply, personal_head))
        return results


def make_sim(tmp_path: Path, sets=(), backend=None, name="run") -> Simulation:
    cfg = tiny_config("fedcp", sets=sets)
    return Simulation(cfg, run_dir=tmp_path / name, tensorboard=False, backend=backend or SerialBackend())


# --- equations on known inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["layernorm", "batchnorm", "groupnorm", "none"])
@pytest.mark.parametrize("gumbel", [False, True])
def test_policy_shares_sum_to_one_per_feature(norm, gumbel):
    torch.manual_seed(0)
    cpn = ConditionalPolicyNetwork(6, layers=2, norm=norm, activation="tanh")
    r, s = cpn(torch.randn(5, 6) * 3, gumbel=gumbel)
    assert r.shape == s.shape == (5, 6)
    torch.testing.assert_close(r + s, torch.ones(5, 6))
    assert bool(((r > 0) & (r < 1)).all())


def test_policy_is_softmax_over_the_pair():
    """Eq. 4 on a CPN whose intermediates are known: r^k = e^{a1} / (e^{a1} + e^{a2})."""
    cpn = ConditionalPolicyNetwork(2, norm="none", activation="relu")
    lin = cpn.net[0]
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4, 2) * 0 + torch.tensor([[1.0, 0], [0, 1.0], [0, 0], [2.0, 0]]))
        lin.bias.zero_()
    c = torch.tensor([[1.0, 3.0]])
    a = torch.relu(lin(c))  # a1 = (1, 3), a2 = (0, 2)
    r, s = cpn(c)
    expect_r = torch.exp(a[0, :2]) / (torch.exp(a[0, :2]) + torch.exp(a[0, 2:]))
    torch.testing.assert_close(r[0], expect_r)
    torch.testing.assert_close(s[0], 1 - expect_r)


def test_client_vector_and_cpn_input_from_known_head():
    head = torch.nn.Linear(3, 2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [3.0, 4.0, 1.5]]))
    v = client_vector(head)
    torch.testing.assert_close(v, torch.tensor([4.0, 2.0, 2.0]))  # column sums = sum_c w_c^T
    assert not v.requires_grad
    h = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.0, 1.0]])
    c = cpn_input(h, v, use_sample_vector=True)
    torch.testing.assert_close(c, h * torch.tensor([4.0, 2.0, 2.0]) / math.sqrt(24.0))
    # ablations: w.o. cs -> h; w.o. ss -> the normalised vector for every sample
    torch.testing.assert_close(cpn_input(h, None, True), h)
    torch.testing.assert_close(cpn_input(h, v, False), (v / v.norm()).expand(2, 3))


def test_mmd_matches_direct_formula():
    torch.manual_seed(1)
    x, y = torch.randn(4, 3), torch.randn(4, 3) + 0.5
    bw = (10.0, 15.0, 20.0, 50.0)

    def k(a, b):
        return sum(math.exp(-float(((a - b) ** 2).sum()) / (2 * s)) for s in bw)

    n = len(x)
    direct = (sum(k(x[i], x[j]) for i in range(n) for j in range(n))
              + sum(k(y[i], y[j]) for i in range(n) for j in range(n))
              - 2 * sum(k(x[i], y[j]) for i in range(n) for j in range(n))) / n ** 2
    assert mmd_rbf(x, y, bw).item() == pytest.approx(direct, rel=1e-5)
    assert mmd_rbf(x, x, bw).item() == pytest.approx(0.0, abs=1e-6)
    assert mmd_rbf(torch.ones(2, 1), torch.zeros(2, 1), (1.0,)).item() == pytest.approx(2 - 2 * math.exp(-0.5))


# --- one client, driven directly ------------------------------------------------------------------------------
def single_trainer(tmp_path: Path, sets=()) -> FedCPTrainer:
    sim = make_sim(tmp_path, sets=sets)
    return sim.backend.trainers[0]


def test_upload_head_is_average_and_frozen_modules_get_no_gradient(tmp_path):
    t = single_trainer(tmp_path)
    glob_before = {k: v.clone() for k, v in t.global_model.state_dict().items()}
    personal_before = {k: v.clone() for k, v in t.model.state_dict().items()}
    reply = t.on_fit({})
    # frozen W^fe and W^hd: no gradient, unchanged; trained parts changed
    assert all(p.grad is None and not p.requires_grad for p in t.global_model.parameters())
    for k, v in t.global_model.state_dict().items():
        torch.testing.assert_close(v, glob_before[k])
    assert any(not torch.equal(v, personal_before[k]) for k, v in t.model.state_dict().items())
    assert all(p.grad is not None for p in t.model.parameters())
    # Eq. 6
    for k in ("head.weight", "head.bias"):
        own = t.model.state_dict()[k]
        torch.testing.assert_close(reply["params"][k], (glob_before[k] + own) / 2)
        assert not torch.equal(reply["params"][k], own)
    assert 0.0 < reply["metrics"]["personal_share"] < 1.0
    assert reply["num_samples"] == t.ctx.num_train


def test_receive_overwrites_both_extractors_global_head_and_cpn_only(tmp_path):
    t = single_trainer(tmp_path)
    params = {k: torch.randn_like(v) for k, v in FedCPAggregator(make_sim(tmp_path, name="s").server_ctx)
              .global_state.items()}
    personal_head = {k: v.clone() for k, v in t.model.head.state_dict().items()}
    t.receive(params)
    sd, gsd, csd = t.model.state_dict(), t.global_model.state_dict(), t.cpn.state_dict()
    for k, v in params.items():
        if k.startswith("features."):
            torch.testing.assert_close(sd[k], v)
            torch.testing.assert_close(gsd[k], v)
        elif k.startswith("head."):
            torch.testing.assert_close(gsd[k], v)
        else:
            torch.testing.assert_close(csd[k[len("cpn."):]], v)
    for k, v in t.model.head.state_dict().items():  # the personal head stays the client's own
        torch.testing.assert_close(v, personal_head[k])


@pytest.mark.parametrize("policy,noisy_train,noisy_eval", [("softmax", False, False), ("gumbel", True, True),
                                                          ("gumbel_train", True, False)])
def test_gumbel_noise_only_where_the_policy_says(tmp_path, policy, noisy_train, noisy_eval):
    t = single_trainer(tmp_path, sets=(f"trainer.policy={policy}",))
    t.v = t.make_client_vector()
    x, _ = t.ctx.train.batch(torch.arange(8))
    for training, noisy in ((True, noisy_train), (False, noisy_eval)):
        torch.manual_seed(1)
        a = t.forward(x, training)[2]
        torch.manual_seed(2)
        b = t.forward(x, training)[2]
        assert torch.equal(a, b) != noisy


def test_random_initial_client_vector_is_replaced_by_the_head_vector(tmp_path):
    t = single_trainer(tmp_path, sets=("trainer.client_vector_init=random",))
    t.on_fit({})
    first = t.v.clone()
    assert not torch.allclose(first, client_vector(t.model.head))  # uniform random, not from the head
    assert bool(((first >= 0) & (first < 1)).all())
    head_before = client_vector(t.model.head)
    t.on_fit({})
    torch.testing.assert_close(t.v, head_before)  # from the 2nd iteration on: v_i from the personal head


def test_server_weights_are_sample_proportional(tmp_path):
    agg = make_sim(tmp_path).server
    keys = list(agg.global_state)
    replies = {}
    for cid, (n, val) in enumerate([(10, 1.0), (30, 2.0), (60, 4.0)]):
        replies[cid] = {"params": {k: torch.full_like(agg.global_state[k], val) for k in keys},
                        "num_samples": n, "train_loss": 0.0}
    agg.aggregate_fit(1, replies)
    expect = (10 * 1.0 + 30 * 2.0 + 60 * 4.0) / 100
    for k in keys:
        if agg.global_state[k].is_floating_point():
            torch.testing.assert_close(agg.global_state[k], torch.full_like(agg.global_state[k], expect))
    assert any(k.startswith("cpn.") for k in keys) and any(k.startswith("head.") for k in keys)


def test_personal_head_never_leaves_its_client(tmp_path):
    backend = RecordingBackend()
    sim = make_sim(tmp_path, backend=backend)
    sim.run()
    fits = [(cid, msg, reply, head) for cid, msg, reply, head in backend.log if msg.kind == "fit"]
    assert len(fits) == 2 * 4
    for cid, _, reply, head in fits:
        assert set(reply) == {"params", "num_samples", "train_loss", "metrics"}
        assert {k.split(".")[0] for k in reply["params"]} == {"features", "head", "cpn"}
        for t in iter_tensors(reply):
            for h in head.values():
                assert not (t.shape == h.shape and torch.allclose(t, h)), f"client {cid} leaked its head"
    for cid, msg, reply, head in backend.log:  # evaluation replies carry sums only
        if msg.kind == "evaluate":
            assert not list(iter_tensors(reply))


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="use_global_head"):
        make_sim(tmp_path, sets=("trainer.use_global_head=false",))
    with pytest.raises(ConfigError, match="cpn_norm"):
        tiny_config("fedcp", sets=("trainer.cpn_norm=instancenorm",))
    with pytest.raises(ConfigError, match="mmd_bandwidths"):
        tiny_config("fedcp", sets=("trainer.mmd_bandwidths=[]",))


def test_defaults_follow_the_paper():
    from pflkit.core.testing import resolve
    cfg = resolve([], algorithm="fedcp")
    assert cfg.model.name == "cnn4"
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.local_epochs) == (0.005, 10, 1)
    assert (cfg.partition.name, cfg.partition.num_clients, cfg.partition.alpha) == ("dirichlet", 20, 0.1)
    assert cfg.participation.join_ratio == 1.0 and cfg.split.test_ratio == 0.25
    assert cfg.trainer.lambda_mmd == 5.0 and cfg.trainer.policy == "softmax"
    assert cfg.aggregator.sync == "paper"


# --- end to end -------------------------------------------------------------------------------------------------
def test_end_to_end_seeded_and_resumable(tmp_path):
    a = quick_run("fedcp", tmp_path / "a", sets=("rounds=3",))
    b = quick_run("fedcp", tmp_path / "b", sets=("rounds=3",))
    assert a["rounds_completed"] == 3 and a["client_failures"] == 0
    assert a["final"] == b["final"]
    assert a["last"]["accuracy/uniform"] > 0.2  # 10 classes: chance is 0.1
    rows = [json.loads(line) for line in (Path(a["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    shares = [r["clients/personal_share"] for r in rows if "clients/personal_share" in r]
    assert len(shares) == 3 and all(0.0 < v < 1.0 for v in shares)
    # stop after round 2 and resume: client state (personal head, CPN, v_i) and server state round-trip
    cfg = tiny_config("fedcp", sets=("rounds=3",))
    Simulation(cfg, run_dir=tmp_path / "c", tensorboard=False).run(stop_after=2)
    c = Simulation.resume(tmp_path / "c", tensorboard=False).run()
    assert c["last"]["accuracy/uniform"] == pytest.approx(a["last"]["accuracy/uniform"])


@pytest.mark.parametrize("sets", [
    ("trainer.use_cpn=false", "trainer.use_gfm=false", "trainer.use_global_head=false"),
    ("trainer.use_client_vector=false", "trainer.use_sample_vector=false", "trainer.cpn_norm=batchnorm",
     "participation.random_join_ratio=[0.25,1]"),
    ("aggregator.sync=reference", "trainer.policy=gumbel", "trainer.client_vector_init=random",
     "participation.join_ratio=0.5"),
])
def test_ablations_and_reference_options_end_to_end(tmp_path, sets):
    s = quick_run("fedcp", tmp_path, sets=sets)
    assert s["rounds_completed"] == 2 and s["client_failures"] == 0
    assert math.isfinite(s["last"]["accuracy/uniform"])


def test_wo_global_head_shares_only_the_extractor(tmp_path):
    backend = RecordingBackend()
    make_sim(tmp_path, backend=backend, sets=("trainer.use_cpn=false", "trainer.use_global_head=false",
                                               "rounds=1")).run()
    for _, msg, reply, _ in backend.log:
        if msg.kind == "fit":
            assert {k.split(".")[0] for k in reply["params"]} == {"features"}
            assert "metrics" not in reply


def test_reference_sync_pushes_extractor_to_all_and_head_to_trained(tmp_path):
    backend = RecordingBackend()
    sim = make_sim(tmp_path, backend=backend, sets=("aggregator.sync=reference", "participation.join_ratio=0.5",
                                                    "rounds=1"))
    sim.run()
    fit_cids = {cid for cid, msg, _, _ in backend.log if msg.kind == "fit"}
    syncs = {cid: msg for cid, msg, _, _ in backend.log if msg.kind == "sync"}
    assert len(fit_cids) == 2 and set(syncs) == {0, 1, 2, 3}
    for cid, msg in syncs.items():
        groups = {k.split(".")[0] for k in msg.payload["params"]}
        assert groups == ({"features", "head", "cpn"} if cid in fit_cids else {"features"})
    # the trained clients now hold the aggregate as extractor, global head and CPN
    glob = sim.server.global_state
    for cid in fit_cids:
        t = backend.trainers[cid]
        for k, v in glob.items():
            if k.startswith("features."):
                torch.testing.assert_close(t.model.state_dict()[k], v)
            elif k.startswith("head."):
                torch.testing.assert_close(t.global_model.state_dict()[k], v)
            else:
                torch.testing.assert_close(t.cpn.state_dict()[k[len("cpn."):]], v)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedcp", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
