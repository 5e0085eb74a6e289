"""FedC2I client and relay: influence aggregation against a direct evaluation, gamma = 0, ablations, relay and
downlink accounting, partial participation, resume, bad input, end to end on the embedded feature-shift data."""
import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from easydict import EasyDict
from torch import nn

from pflkit.core import (ClientContext, ConfigError, MODELS, Message, Simulation, SplitModel, TensorData,
                         classification, payload_nbytes)
from pflkit.core.testing import cli, tiny_config
from pflkit_fedc2i import FedC2IRelay, FedC2ITrainer

torch.set_num_threads(1)

HP = dict(gamma=5.0, client_level="influence", class_level="influence", eq10="weighted", class_features="own",
          influence_batch=1000)
TRAIN_CFG = EasyDict(optimizer="adam", lr=1e-3, momentum=0.0, weight_decay=0.0, batch_size=4, local_epochs=1,
                     eval_batch_size=64)
DOMAINS4 = ["original", "thick", "inverted", "rotated"]
# four domains, four clients, the core's tiny MLP; no pictures (matplotlib is slow to start)
TINY4 = {"dataset": {"domains": DOMAINS4}, "partition": {"num_clients": 4}, "aggregator": {"plot_every": 0}}


def small_model() -> SplitModel:
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(3, 2), nn.Tanh()), nn.Linear(2, 3), 2)


def random_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in small_model().state_dict().items()}


def make_client(cid: int = 0, **hp) -> FedC2ITrainer:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 3, generator=g)
    y = torch.arange(12) % 3
    data = TensorData(x, y)
    ctx = ClientContext(cid=cid, train=data, test=data, task=classification(3), device=torch.device("cpu"),
                        hp=EasyDict({**HP, **hp}), train_cfg=TRAIN_CFG, build_model=small_model, num_clients=3,
                        seed=0)
    ctx.generator.manual_seed(1)
    return FedC2ITrainer(ctx)


def aggregate(client: FedC2ITrainer, states):
    """Load states[own] into the client, relay the others, run Eq. 4-10; returns (lambda, Lambda, new state)."""
    own = client.ctx.cid
    client.model.load_state_dict(states[own])
    cids, sts = client._relay_set({c: s for c, s in enumerate(states) if c != own})
    lam, class_lam = client.influence_aggregate(cids, sts)
    return lam, class_lam, client.model.state_dict()


def direct_loss(state, x, y) -> float:
    model = small_model()
    model.load_state_dict(state)
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def test_influence_aggregation_matches_a_direct_evaluation_of_eq4_to_eq10():
    states = [random_state(s) for s in (1, 2, 3)]
    client = make_client(cid=1, gamma=2.0)
    lam, class_lam, new = aggregate(client, copy.deepcopy(states))
    x, y = client.ctx.train.x, client.ctx.train.y  # influence_batch >= n: B is the whole training split
    theta = [k for k in states[0] if k.startswith("features.")]
    # Eq. 4-5: model {theta^{-i}, phi_1}, evaluated directly
    losses = []
    for i in range(3):
        s = dict(states[1])
        for k in theta:
            s[k] = sum(states[j][k] for j in range(3) if j != i) / 2
        losses.append(direct_loss(s, x, y))
    lam_ref = torch.tensor(losses, dtype=torch.float64) ** 2
    lam_ref /= lam_ref.sum()
    assert torch.allclose(lam, lam_ref, atol=1e-6)
    # Eq. 6
    for k in theta:
        assert torch.allclose(new[k], sum(lam_ref[i].float() * states[i][k] for i in range(3)), atol=1e-6)
    # Eq. 7-9: phi_1 with row c replaced by the mean of row c over the clients other than i, own theta
    class_ref = torch.zeros(3, 3, dtype=torch.float64)
    for i in range(3):
        for c in range(3):
            s = dict(states[1])
            s["head.weight"] = states[1]["head.weight"].clone()
            s["head.bias"] = states[1]["head.bias"].clone()
            others = [j for j in range(3) if j != i]
            s["head.weight"][c] = sum(states[j]["head.weight"][c] for j in others) / 2
            s["head.bias"][c] = sum(states[j]["head.bias"][c] for j in others) / 2
            class_ref[i, c] = direct_loss(s, x, y) ** 2
    class_ref /= class_ref.sum(dim=0, keepdim=True)
    assert torch.allclose(class_lam, class_ref, atol=1e-6)
    # Eq. 10 (weighted reading): row c = sum_i Lambda^{i,c} phi_{i,c}
    for c in range(3):
        row = sum(class_ref[i, c].float() * states[i]["head.weight"][c] for i in range(3))
        assert torch.allclose(new["head.weight"][c], row, atol=1e-6)
        assert new["head.bias"][c] == pytest.approx(float(sum(class_ref[i, c] * states[i]["head.bias"][c]
                                                             for i in range(3))), abs=1e-6)


def test_gamma_zero_is_uniform_averaging():
    states = [random_state(s) for s in (4, 5, 6, 7)]
    client = make_client(cid=2, gamma=0.0)
    lam, class_lam, new = aggregate(client, copy.deepcopy(states))
    assert torch.equal(lam, torch.full((4,), 0.25, dtype=torch.float64))
    assert torch.equal(class_lam, torch.full((4, 3), 0.25, dtype=torch.float64))
    for k in states[0]:
        assert torch.allclose(new[k], sum(s[k] for s in states) / 4, atol=1e-6), k


def test_ablations_and_the_printed_eq10():
    states = [random_state(s) for s in (1, 2, 3)]
    mean = {k: sum(s[k] for s in states) / 3 for k in states[0]}
    # FedC2I-Lambda/l: theta stays own; Lambda/g: theta is the plain mean
    _, _, local = aggregate(make_client(cid=0, client_level="local"), copy.deepcopy(states))
    _, _, glob = aggregate(make_client(cid=0, client_level="mean"), copy.deepcopy(states))
    for k in ("features.1.weight", "features.1.bias"):
        assert torch.equal(local[k], states[0][k])
        assert torch.allclose(glob[k], mean[k], atol=1e-6)
    # FedC2I-lambda: the classifier follows the client-level lambda (whole model by Eq. 6)
    lam, _, whole = aggregate(make_client(cid=0, class_level="client"), copy.deepcopy(states))
    assert torch.allclose(whole["head.weight"], sum(lam[i].float() * states[i]["head.weight"] for i in range(3)),
                          atol=1e-6)
    _, _, own_head = aggregate(make_client(cid=0, class_level="local"), copy.deepcopy(states))
    assert torch.equal(own_head["head.weight"], states[0]["head.weight"])
    # Eq. 10 as printed reduces to phi_m: the classifier does not change
    _, _, printed = aggregate(make_client(cid=0, eq10="printed"), copy.deepcopy(states))
    assert torch.equal(printed["head.weight"], states[0]["head.weight"])
    assert torch.equal(printed["head.bias"], states[0]["head.bias"])


def test_alone_in_the_relay_set_keeps_its_model():
    client = make_client(cid=0)
    state = random_state(3)
    lam, class_lam, new = aggregate(client, [state])
    assert lam.tolist() == [1.0] and all(torch.equal(new[k], state[k]) for k in state)


def test_fit_reply_is_plain_data_with_the_influence_vector():
    states = [random_state(s) for s in (1, 2, 3)]
    client = make_client(cid=0)
    client.model.load_state_dict(states[0])
    reply = client.handle(Message("fit", {"uploads": {1: states[1], 2: states[2]}}))
    assert set(reply["params"]) == set(states[0]) and reply["influence_clients"] == [0, 1, 2]
    assert reply["influence"].sum().item() == pytest.approx(1.0, abs=1e-6)
    assert set(reply["metrics"]) == {"self_influence", "class_self_influence"}
    assert all(isinstance(v, float) for v in reply["metrics"].values())
    # the relayed tensors are read, never modified in place
    assert torch.equal(states[1]["head.weight"], random_state(2)["head.weight"])


def _model_bytes(cfg) -> int:
    from pflkit.core.testing import make_model_factory

    build = make_model_factory(cfg, (3, 16, 16), 10, torch.device("cpu"))
    return payload_nbytes(build().state_dict())


def test_relay_and_downlink_accounting(tmp_path):
    cfg = tiny_config("fedc2i", TINY4)
    sim = Simulation(cfg, run_dir=Path(tmp_path) / "run", tensorboard=False)
    summary = sim.run()
    w = _model_bytes(cfg)
    m, rounds = 4, cfg.rounds
    # every client receives the 3 other clients' latest models each round; evaluation is not accounted
    assert summary["bytes_down_total"] == rounds * m * (m - 1) * w
    # upload: its model + num_samples, train_loss (8 bytes each), lambda (4 float32), its 4 client ids, 2 metrics
    assert summary["bytes_up_total"] == rounds * m * (w + 8 + 8 + 4 * 4 + 4 * 8 + 2 * 8)
    # the server aggregates nothing: what it stores and relays are the clients' own models
    for cid in range(m):
        held = sim.backend.get_state(cid)["model"]
        assert all(torch.equal(held[k], sim.server.latest[cid][k]) for k in held)
    msgs = sim.server.configure_fit(rounds + 1, [0, 2])
    assert sorted(msgs[0].payload["uploads"]) == [1, 2, 3] and sorted(msgs[2].payload["uploads"]) == [0, 1, 3]
    assert msgs[0].payload["uploads"][3] is sim.server.latest[3]  # relayed as stored, not re-aggregated


@pytest.mark.parametrize("relay", ["all", "selected"])
def test_partial_participation(tmp_path, relay):
    cfg = tiny_config("fedc2i", {**TINY4, "participation": {"join_ratio": 0.5},
                                       "aggregator": {"relay": relay, "plot_every": 0}})
    sim = Simulation(cfg, run_dir=Path(tmp_path) / "run", tensorboard=False)
    before = {c: {k: v.clone() for k, v in sim.backend.get_state(c)["model"].items()} for c in sim.client_ids}
    selected = sim.select_clients(1)
    assert len(selected) == 2
    record = sim.run_round(1)
    w = _model_bytes(cfg)
    others = 3 if relay == "all" else 1  # all: every other client's latest (initial) model; selected: the partner
    assert record["bytes_down"] == len(selected) * others * w
    for c in sim.client_ids:
        after = sim.backend.get_state(c)["model"]
        assert any(not torch.equal(after[k], before[c][k]) for k in after) == (c in selected)
    assert sorted(sim.server.latest) == selected
    # next round: a non-participant is relayed with its last model, here still the initial one (relay=all)
    nxt = sim.select_clients(2)
    payload = sim.server.configure_fit(2, nxt)[nxt[0]].payload["uploads"]
    if relay == "all":
        never = [c for c in sim.client_ids if c not in selected and c != nxt[0]]
        assert sorted(payload) == [c for c in sim.client_ids if c != nxt[0]]
        assert all(payload[c] is sim.server.initial for c in never)
    else:
        assert sorted(payload) == [c for c in nxt if c != nxt[0]]
    # the influence vectors of the round's participants were recorded (rows of the others stay unknown)
    mat = sim.server.matrix
    assert all(np.isfinite(mat[c]).sum() == (4 if relay == "all" else 2) for c in selected)
    assert all(np.isnan(mat[c]).all() for c in sim.client_ids if c not in selected)


def read_jsonl(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def test_resume_reaches_the_same_numbers(tmp_path):
    over = {**TINY4, "rounds": 4, "checkpoint": {"every": 2}, "participation": {"join_ratio": 0.5}}
    full = Simulation(tiny_config("fedc2i", over), run_dir=tmp_path / "full", tensorboard=False).run()
    part = Simulation(tiny_config("fedc2i", over), run_dir=tmp_path / "part", tensorboard=False).run(stop_after=2)
    assert part["interrupted"] and part["rounds_completed"] == 2
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["final"] == full["final"] and resumed["best"] == full["best"]
    assert read_jsonl(tmp_path / "part") == read_jsonl(tmp_path / "full")


def test_bad_input_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match="trainer.gamma"):
        tiny_config("fedc2i", TINY4, sets=("trainer.gamma=-1",))
    with pytest.raises(ConfigError, match="trainer.eq10"):
        tiny_config("fedc2i", TINY4, sets=("trainer.eq10=literal",))

    def two_layer_head(input_shape, num_classes):
        return SplitModel(nn.Flatten(), nn.Sequential(nn.Linear(768, 8), nn.ReLU(), nn.Linear(8, num_classes)), 768)

    MODELS.register("fedc2i_test_mlp_head", two_layer_head, replace=True)
    try:
        res = CliRunner().invoke(cli, ["run", "--plugin", "fedc2i", "--no-progress", "--set",
                                       f"output_dir={tmp_path}", "--set", "model.name=fedc2i_test_mlp_head",
                                       "--set", "rounds=1"], catch_exceptions=False)
        assert res.exit_code == 2, res.output
        assert "linear classifier" in res.output and "Traceback" not in res.output
    finally:
        MODELS._entries.pop("fedc2i_test_mlp_head", None)
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedc2i", "--set", "trainer.gamma=-0.5"])
    assert res.exit_code == 2 and "trainer.gamma" in res.output


def test_every_option_value_can_be_set_from_the_command_line():
    for section, cls in (("trainer", FedC2ITrainer), ("aggregator", FedC2IRelay)):
        for key, param in cls.params.items():
            for value in param.choices or ():
                assert tiny_config("fedc2i", TINY4, sets=(f"{section}.{key}={value}",))[section][key] == value


def test_end_to_end_fl_run_on_the_embedded_feature_shift_data(tmp_path):
    args = ["run", "--plugin", "fedc2i", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
            "--set", "rounds=2", "--set", 'dataset.domains=["original","inverted","rotated"]',
            "--set", "partition.num_clients=3", "--set", "checkpoint.every=0"]
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = CliRunner().invoke(cli, args, catch_exceptions=False)
    finally:
        os.chdir(old)
    assert res.exit_code == 0, res.output
    run = tmp_path / "r"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["name"] == "lenet" and cfg["train"]["optimizer"] == "adam" and cfg["trainer"]["gamma"] == 5.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["final"]["uniform"] > 0.15  # 10 classes
    last = read_jsonl(run)[-1]
    row = [last[f"fedc2i/influence/0/{i}"] for i in range(3)]
    assert sum(row) == pytest.approx(1.0, abs=1e-5)
    assert 0 < last["clients/self_influence"] < 1
    # the influence matrix, drawn with the domain names, as PNG files and a TensorBoard image
    assert (run / "influence_matrix.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "influence").iterdir()) == ["round_001.png", "round_002.png"]
    assert any((run / "tb").iterdir())


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["digits_domains.toml", "digit5.toml", "office10.toml"])
def test_shipped_configs_resolve_and_name_missing_data(name, tmp_path):
    from pflkit.core import DataError
    from pflkit.core.testing import load_file, resolve
    from pflkit.core import build_federated_data

    layer = load_file(CONFIGS / name)
    cfg = resolve([layer, {"dataset": {"root": str(tmp_path)}}], algorithm="fedc2i")
    assert cfg.model.name == "lenet" and cfg.train.optimizer == "adam" and cfg.train.local_epochs == 2
    if name == "digits_domains.toml":  # the comparison's shared settings apply to the baselines too
        for algo in ("local", "fedavg", "fedprox", "fedrep"):
            assert resolve([layer], algorithm=algo).train.lr == 0.001
        return
    with pytest.raises(DataError, match=str(tmp_path)):  # offline and empty: the error names where to put what
        build_federated_data(cfg)


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedc2i", {"dataset": {"name": "digits"}, "partition": {"name": "dirichlet", "num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
