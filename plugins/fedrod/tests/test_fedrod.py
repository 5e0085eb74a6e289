"""FedRoD: the two losses on hand-made tensors, what each loss may move, what travels, resume, end to end."""
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from easydict import EasyDict
from torch import nn

from pflkit.core import (ClientContext, ConfigError, Simulation, SplitModel, TensorData, classification,
                         make_optimizer, minibatches, payload_nbytes, run_sgd)
from pflkit.core.testing import cli, quick_run, run_capturing_replies, tiny_config
from pflkit_fedrod import (FedRoDTrainer, balanced_softmax_loss, class_counts, personalized_logits,
                           personalized_loss)

TRAIN_CFG = EasyDict(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=8, local_epochs=2,
                     eval_batch_size=64)
HP = dict(bn_stats="shared", bsm_gamma=1.0, personal_init="zeros", personal_lr=None, eval_model="personal")


# -- the equations on hand-made tensors ----------------------------------------------------------------------
def test_class_counts():
    assert class_counts(torch.tensor([2, 0, 2, 2]), 4).tolist() == [1.0, 0.0, 3.0, 0.0]


def test_balanced_softmax_hand_computed():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    y = torch.tensor([2])
    # counts (0, 1, 2): -log(2 e^3 / (0 e^1 + 1 e^2 + 2 e^3)) = log(1 + e^-1 / 2); class 0 drops out
    assert balanced_softmax_loss(logits, y, torch.tensor([0.0, 1.0, 2.0])).item() == \
        pytest.approx(math.log(1 + math.exp(-1) / 2), rel=1e-6)
    # gamma = 2, counts (1, 1, 2), label 0: -log(e^1 / (e^1 + e^2 + 4 e^3)) = log(1 + e + 4 e^2)
    assert balanced_softmax_loss(logits, torch.tensor([0]), torch.tensor([1.0, 1.0, 2.0]), gamma=2.0).item() == \
        pytest.approx(math.log(1 + math.e + 4 * math.e ** 2), rel=1e-6)
    # gamma = 0 is plain cross-entropy, whatever the counts (even zero ones)
    assert balanced_softmax_loss(logits, y, torch.tensor([0.0, 1.0, 2.0]), gamma=0.0).item() == \
        pytest.approx(math.log(1 + math.exp(-1) + math.exp(-2)), rel=1e-6)
    # balanced classes: the prior is a constant shift, i.e. BSM = CE
    assert balanced_softmax_loss(logits, y, torch.tensor([5.0, 5.0, 5.0])).item() == \
        pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-6)


def test_balanced_softmax_gives_absent_classes_no_gradient():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.0, -1.0]], requires_grad=True)
    balanced_softmax_loss(logits, torch.tensor([2, 1]), torch.tensor([0.0, 1.0, 2.0])).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[:, 0].abs().max().item() == 0.0  # class 0 is not in the client's data
    assert logits.grad[:, 1:].abs().sum().item() > 0


def test_personalized_prediction_and_loss():
    g = torch.tensor([[1.0, 0.0, -1.0]], requires_grad=True)
    p = torch.tensor([[0.0, 2.0, 0.5]], requires_grad=True)
    assert personalized_logits(g, p).tolist() == [[1.0, 2.0, -0.5]]
    loss = personalized_loss(g, p, torch.tensor([1]))
    assert loss.item() == pytest.approx(-math.log(math.exp(2) / (math.e + math.exp(2) + math.exp(-0.5))), rel=1e-6)
    loss.backward()
    assert g.grad is None  # the generic scores enter detached: this loss never trains theta, psi
    assert p.grad is not None and p.grad.abs().sum() > 0


# -- the client ----------------------------------------------------------------------------------------------
def small_model() -> SplitModel:
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 3), 8)


def make_client(cid: int = 0, **hp) -> FedRoDTrainer:
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(30, 6, generator=g)
    y = torch.randint(0, 2, (30,), generator=g)  # label skew: class 2 absent from this client
    data = TensorData(x, y)
    ctx = ClientContext(cid=cid, train=data, test=data, task=classification(3), device=torch.device("cpu"),
                        hp=EasyDict({**HP, **hp}), train_cfg=TRAIN_CFG, build_model=small_model, num_clients=2,
                        seed=0)
    ctx.generator.manual_seed(7)
    return FedRoDTrainer(ctx)


def test_shared_model_is_trained_by_the_balanced_loss_alone():
    client = make_client()
    reply = client.on_fit({})
    # the same batches, the same optimiser, Balanced Softmax only: the uploaded model must be identical
    ref = small_model()
    counts = class_counts(client.ctx.train.y, 3)
    gen = torch.Generator().manual_seed(7)
    run_sgd(minibatches(client.ctx.train, 8, 2, generator=gen),
            lambda x, y: balanced_softmax_loss(ref(x), y, counts), make_optimizer(ref.parameters(), TRAIN_CFG))
    for k, v in ref.state_dict().items():
        assert torch.allclose(reply["params"][k], v, atol=1e-6), k
    # ... whatever the personal head does (another init and learning rate change nothing upstream)
    other = make_client(personal_init="generic", personal_lr=0.5).on_fit({})
    for k in reply["params"]:
        assert torch.allclose(reply["params"][k], other["params"][k], atol=1e-6), k


def test_personal_head_stays_local_and_learns():
    client = make_client()
    assert all(p.abs().sum() == 0 for p in client.personal_head.parameters())  # zero init
    reply = client.on_fit({})
    assert set(reply["params"]) == set(client.model.state_dict())  # body + generic head, nothing personal
    assert set(reply["metrics"]) == {"bsm_loss", "personal_loss"}
    assert all(isinstance(v, float) for v in reply["metrics"].values())
    assert reply["train_loss"] == pytest.approx(reply["metrics"]["bsm_loss"] + reply["metrics"]["personal_loss"],
                                                rel=1e-5)
    assert client.personal_head.weight.abs().sum() > 0
    assert set(client.state_dict()) == {"model", "personal_head"}


def test_evaluation_scores_generic_plus_personal():
    client = make_client()
    client.on_fit({})
    x, y = client.ctx.test.all()
    with torch.no_grad():
        z = client.model.features(x)
        generic = client.model.head(z)
        personal = generic + client.personal_head(z)
    res = client.on_evaluate({})
    assert res["metric_sum"] == float((personal.argmax(1) == y).sum())
    assert res["loss_sum"] == pytest.approx(float(nn.functional.cross_entropy(personal, y, reduction="sum")),
                                            rel=1e-5)
    client.ctx.hp.eval_model = "generic"
    assert client.on_evaluate({})["metric_sum"] == float((generic.argmax(1) == y).sum())


def test_zero_initial_personal_head_starts_from_the_generic_model():
    client = make_client()
    personal = client.on_evaluate({})
    client.ctx.hp.eval_model = "generic"
    assert client.on_evaluate({}) == personal
    copied = make_client(personal_init="generic")
    assert torch.equal(copied.personal_head.weight, copied.model.head.weight)


def test_model_without_head_is_a_config_error():
    client = make_client()
    ctx = client.ctx
    ctx.build_model = lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, 3))
    with pytest.raises(ConfigError, match="feature-extractor / head split"):
        FedRoDTrainer(ctx)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="trainer.bsm_gamma"):
        tiny_config("fedrod", sets=("trainer.bsm_gamma=-1",))
    with pytest.raises(ConfigError, match="trainer.personal_init"):
        tiny_config("fedrod", sets=("trainer.personal_init=random",))
    with pytest.raises(ConfigError, match="trainer.personal_lr"):
        tiny_config("fedrod", sets=("trainer.personal_lr=0",))


def test_every_option_value_can_be_set_from_the_command_line():
    for key, param in FedRoDTrainer.params.items():
        for value in param.choices or ():
            assert tiny_config("fedrod", sets=(f"trainer.{key}={value}",)).trainer[key] == value


# -- runs ----------------------------------------------------------------------------------------------------
def test_what_travels_and_its_byte_count(tmp_path):
    sim = Simulation(tiny_config("fedrod"), run_dir=tmp_path / "run", tensorboard=False)
    captured = run_capturing_replies(sim)
    summary = sim.summary()
    model_keys = set(sim.build_model().state_dict())
    n = sum(v.numel() for v in sim.build_model().state_dict().values())
    for replies in captured.values():
        for reply in replies.values():
            assert set(reply) == {"params", "num_samples", "train_loss", "metrics"}
            assert set(reply["params"]) == model_keys  # body + generic head; the personal head never leaves
    # per client and round: up = model (4 bytes/entry) + num_samples + train_loss + 2 metrics; down = the model
    assert summary["bytes_up_total"] == 2 * 4 * (4 * n + 4 * 8)
    assert summary["bytes_down_total"] == 2 * 4 * (4 * n)
    heads = [t.personal_head.weight.detach() for _, t in sorted(sim.backend.trainers.items())]
    assert all(not torch.equal(heads[0], h) for h in heads[1:])  # personal heads differ between clients


def test_resume_reaches_the_same_numbers(tmp_path):
    over = {"rounds": 3, "participation": {"join_ratio": 0.5}}
    full = Simulation(tiny_config("fedrod", over), run_dir=tmp_path / "full", tensorboard=False).run()
    Simulation(tiny_config("fedrod", over), run_dir=tmp_path / "part", tensorboard=False).run(stop_after=2)
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == 3
    assert resumed["final"] == full["final"] and resumed["last"] == full["last"]


def test_fl_run_end_to_end_on_the_feature_shift_dataset(tmp_path):
    res = CliRunner().invoke(cli, [
        "run", "--plugin", "fedrod", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=r",
        "--set", "dataset.name=digits_domains", "--set", "partition.name=by_group", "--set", "partition.num_clients=6",
        "--set", "model.name=mlp", "--set", "model.hidden=[16]", "--set", "rounds=2", "--set", "checkpoint.every=0"],
        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "fedrod (trainer fedrod, aggregator fedavg)" in res.output and "digits_domains / 6" in res.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["client_failures"] == 0 and summary["final"]["uniform"] > 0.15  # 10 classes: chance 0.1
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if ln]
    assert all("clients/bsm_loss" in r and "clients/personal_loss" in r for r in rows)


def test_regression_data_is_a_clear_cli_error(tmp_path):
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedrod", "--no-progress", "--set", f"output_dir={tmp_path}",
                                   "--set", "dataset.name=pcfl_sine", "--set", "model.name=mlp"])
    assert res.exit_code == 2
    assert "FedRoD needs a classification task" in res.output and "Traceback" not in res.output


def test_quick_run_ablations(tmp_path):
    s = quick_run("fedrod", tmp_path, sets=("trainer.bsm_gamma=0", "trainer.personal_init=generic",
                                            "trainer.eval_model=generic", "trainer.bn_stats=local"))
    assert s["rounds_completed"] == 2 and s["client_failures"] == 0 and math.isfinite(s["final"]["uniform"])


def test_batched_matches_sequential(tmp_path):
    """clients.batched=on: one round's replies and 3 rounds' scores equal the sequential path's (float rounding)."""
    from pflkit.core.testing import assert_batched_matches_sequential
    assert_batched_matches_sequential("fedrod", {"partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]}, "train": {"batch_size": 10}}, tmp_path)
