"""FedCAC trainer + aggregator: BN statistics, per-client downloads, partial participation, wire cost, end to end."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from easydict import EasyDict
from torch import nn

from pflkit.core import (BitMask, ClientContext, ConfigError, Message, ServerContext, Simulation, SplitModel,
                         TensorData, bn_keys, classification, payload_nbytes)
from pflkit.core.testing import make_model_factory, quick_run, tiny_config
from pflkit_fedcac import FedCACAggregator, FedCACTrainer

TRAIN_CFG = EasyDict(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=8, local_epochs=2,
                     eval_batch_size=64)
AGG_HP = dict(beta=100.0, overlap="similarity", collaboration="time_varying", top_k=5, non_critical="all",
              global_weighting="uniform", log_overlap_every=0)


def bn_model() -> SplitModel:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
    return SplitModel(features, nn.Linear(8, 3), 8)


def make_client(cid: int, tau: float = 0.5, selection: str = "sensitivity") -> FedCACTrainer:
    g = torch.Generator().manual_seed(100 + cid)
    # each client its own label skew and input shift, so models, masks and BN statistics differ
    x = torch.randn(24, 6, generator=g) + cid
    y = torch.randint(0, 3, (24,), generator=g) % (cid + 1)
    data = TensorData(x, y)
    ctx = ClientContext(cid=cid, train=data, test=data, task=classification(3), device=torch.device("cpu"),
                        hp=EasyDict(tau=tau, selection=selection), train_cfg=TRAIN_CFG, build_model=bn_model,
                        num_clients=4, seed=0)
    ctx.generator.manual_seed(cid)
    return FedCACTrainer(ctx)


def make_server(**hp) -> FedCACAggregator:
    keys = FedCACTrainer.shared_keys(bn_model(), EasyDict())
    ctx = ServerContext(hp=EasyDict({**AGG_HP, **hp}), cfg=EasyDict(), task=classification(3), num_clients=4,
                        build_model=bn_model, shared_keys=keys, device=torch.device("cpu"), seed=0, logger=None,
                        rng=np.random.default_rng(0))
    return FedCACAggregator(ctx)


def test_bn_running_statistics_never_leave_and_survive_aggregation():
    clients = [make_client(c) for c in range(3)]
    server = make_server()
    stats_keys = bn_keys(clients[0].model)
    assert stats_keys and not set(stats_keys) & set(clients[0].shared)
    replies = {c.ctx.cid: c.handle(Message("fit")) for c in clients}
    for r in replies.values():
        assert not set(stats_keys) & set(r["params"]) and not set(stats_keys) & set(r["mask"])
    after_training = {c.ctx.cid: {k: c.model.state_dict()[k].clone() for k in stats_keys} for c in clients}
    push = server.aggregate_fit(1, replies)
    for cid, msg in push.items():
        assert msg.kind == "update" and not set(stats_keys) & set(msg.payload["params"])
        clients[cid].handle(msg)
    for c in clients:
        sd = c.model.state_dict()
        for k in stats_keys:
            assert torch.equal(sd[k], after_training[c.ctx.cid][k])  # untouched by aggregation
    # and still personal: clients' running means differ
    key = next(k for k in stats_keys if k.endswith("running_mean"))
    assert not torch.allclose(clients[0].model.state_dict()[key], clients[2].model.state_dict()[key])


def _replies(values, masks):
    """Hand-made uploads: one parameter tensor 'w' per client."""
    return {cid: {"params": {"w": torch.tensor(v)}, "mask": {"w": BitMask(torch.tensor(m))},
                  "num_samples": 10, "train_loss": 0.0} for cid, (v, m) in enumerate(zip(values, masks))}


def _server_for_w(**hp) -> FedCACAggregator:
    ctx = ServerContext(hp=EasyDict({**AGG_HP, **hp}), cfg=EasyDict(), task=classification(3), num_clients=3,
                        build_model=lambda: nn.Module(), shared_keys=None, device=torch.device("cpu"), seed=0,
                        logger=None, rng=np.random.default_rng(0))
    server = FedCACAggregator.__new__(FedCACAggregator)
    server.ctx, server.keys, server.shapes, server.last_round = ctx, ["w"], {"w": (4,)}, {}
    return server


def test_per_client_downloads_differ_when_masks_differ():
    values = [[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0], [5.0, 9.0, 1.0, 2.0]]
    server = _server_for_w(collaboration="local")
    w_bar = torch.tensor(values).mean(0)
    # same masks -> same non-critical entries; the critical ones are each client's own (no collaboration)
    masks = [[True, True, False, False], [False, False, True, True], [True, False, True, False]]
    push = server.aggregate_fit(1, _replies(values, masks))
    downloads = {c: m.payload["params"]["w"] for c, m in push.items()}
    for c in range(3):
        mask = torch.tensor(masks[c])
        assert torch.allclose(downloads[c][mask], torch.tensor(values[c])[mask])
        assert torch.allclose(downloads[c][~mask], w_bar[~mask])
    assert not torch.allclose(downloads[0], downloads[1]) and not torch.allclose(downloads[1], downloads[2])
    # identical masks and no collaboration on identical models would give identical downloads
    same = server.aggregate_fit(1, _replies([values[0]] * 3, [masks[0]] * 3))
    assert all(torch.equal(m.payload["params"]["w"], torch.tensor(values[0])) for m in same.values())


def test_ablation_options_change_the_download():
    values = [[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0], [5.0, 9.0, 1.0, 2.0]]
    masks = [[True, True, False, False], [True, True, False, False], [False, False, True, True]]
    # as_critical + no collaboration: every parameter stays the client's own
    local = _server_for_w(collaboration="local", non_critical="as_critical").aggregate_fit(1, _replies(values, masks))
    for c in range(3):
        assert torch.equal(local[c].payload["params"]["w"], torch.tensor(values[c]))
    # top_k = 1: clients 0 and 1 have identical masks, so they help each other on their critical entries
    topk = _server_for_w(collaboration="top_k", top_k=1).aggregate_fit(1, _replies(values, masks))
    assert torch.allclose(topk[0].payload["params"]["w"][:2], torch.tensor([2.0, 3.0]))
    # samples weighting changes w_bar when sample counts differ
    rep = _replies(values, masks)
    rep[2]["num_samples"] = 30
    weighted = _server_for_w(global_weighting="samples", collaboration="local").aggregate_fit(1, rep)
    assert torch.allclose(weighted[0].payload["params"]["w"][2:], torch.tensor([(3 + 5 + 3) / 5, (4 + 6 + 6) / 5]))


def test_time_varying_collaboration_ends_after_beta():
    values = [[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0], [5.0, 9.0, 1.0, 2.0]]
    masks = [[True, True, False, False], [True, True, True, False], [False, False, True, True]]
    server = _server_for_w(beta=2.0)
    server.aggregate_fit(1, _replies(values, masks))
    assert server.last_round["collaborators"].any()
    server.aggregate_fit(3, _replies(values, masks))
    assert not server.last_round["collaborators"].any()


def test_partial_participation_uses_only_repliers():
    values = [[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0], [5.0, 9.0, 1.0, 2.0]]
    masks = [[True, False, False, False], [True, False, False, False], [False, False, False, True]]
    replies = _replies(values, masks)
    del replies[1]  # client 1 was not selected or dropped out
    server = _server_for_w(collaboration="local")
    push = server.aggregate_fit(4, replies)
    assert sorted(push) == [0, 2] and server.last_round["clients"] == [0, 2]
    w_bar = (torch.tensor(values[0]) + torch.tensor(values[2])) / 2
    assert torch.allclose(push[0].payload["params"]["w"][1:], w_bar[1:])
    assert server.last_round["overlap"].shape == (2, 2)
    assert server.aggregate_fit(5, {}) is None


def test_partial_participation_in_a_run_leaves_others_untouched(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_config("fedcac", {"participation": {"join_ratio": 0.5}})
    sim = Simulation(cfg, run_dir=Path(tmp_path) / "run", tensorboard=False)
    before = {c: sim.backend.get_state(c)["model"] for c in sim.client_ids}
    before = {c: {k: v.clone() for k, v in s.items()} for c, s in before.items()}
    selected = sim.select_clients(1)
    sim.run_round(1)
    assert 0 < len(selected) < len(sim.client_ids)
    for c in sim.client_ids:
        after = sim.backend.get_state(c)["model"]
        changed = any(not torch.equal(after[k], before[c][k]) for k in after)
        assert changed == (c in selected)
    assert sim.server.last_round["clients"] == selected


def test_mask_travels_as_bits():
    client = make_client(0)
    reply = client.handle(Message("fit"))
    model_bytes = payload_nbytes(reply["params"])
    mask_bytes = payload_nbytes(reply["mask"])
    n = sum(v.numel() for v in reply["params"].values())
    assert model_bytes == 4 * n
    assert n / 8 <= mask_bytes <= n / 8 + len(reply["mask"])  # one bit per entry, padded per tensor
    assert 0.4 < reply["metrics"]["critical_fraction"] <= 0.6


def test_bad_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="trainer.tau"):
        tiny_config("fedcac", sets=("trainer.tau=1.5",))
    with pytest.raises(ConfigError, match="aggregator.collaboration"):
        tiny_config("fedcac", sets=("aggregator.collaboration=sometimes",))


def test_end_to_end_on_digits(tmp_path):
    torch.set_num_threads(1)
    summary = quick_run("fedcac", tmp_path, overrides={"aggregator": {"beta": 2.0, "log_overlap_every": 1}})
    assert summary["rounds_completed"] == 2
    assert summary["final"]["uniform"] > 0.3  # 10 classes: chance is 0.1
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    r1 = next(r for r in records if r.get("round") == 1)
    assert "fedcac/threshold" in r1 and "fedcac/collaborators_mean" in r1
    assert 0.3 < r1["clients/critical_fraction"] <= 0.55  # tau = 0.5, floor per tensor, ties at the cut
    # uplink = model (32 bits/entry) + mask (1 bit/entry) + 3 scalars, per client per round;
    # downlink = one Eq. (11) model per participant (the evaluation messages are not accounted)
    build = make_model_factory(tiny_config("fedcac"), (1, 8, 8), 10, torch.device("cpu"))
    n = sum(p.numel() for p in build().parameters())
    per_client = 4 * n + n / 8
    assert summary["bytes_up_total"] == pytest.approx(2 * 4 * per_client, rel=0.01)
    assert summary["bytes_down_total"] == pytest.approx(2 * 4 * 4 * n, rel=0.01)


def test_every_option_value_can_be_set_from_the_command_line():
    # --set values are parsed (e.g. 'none' becomes null), so every choice must survive the round trip
    for section, cls in (("trainer", FedCACTrainer), ("aggregator", FedCACAggregator)):
        for key, param in cls.params.items():
            for value in param.choices or ():
                cfg = tiny_config("fedcac", sets=(f"{section}.{key}={value}",))
                assert cfg[section][key] == value


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedcac", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
