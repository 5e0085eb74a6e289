"""Batched execution of a round's clients (clients.batched, core/engine/batched.py): the same numbers as the
sequential path within float tolerance, per-client isolation kept, and the decision said plainly."""
import json
import time

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import LocalSGDTrainer
from pflkit.core.api.training import TensorData, batch_indices, minibatches
from pflkit.core.cli.main import cli
from pflkit.core.common.errors import ConfigError
from pflkit.core.engine import batched as B
from pflkit.core.testing import (OneTrainerPerClient, assert_resume_matches_full_run, assert_run_refused,
                                 assert_streaming_matches_all_replies, one_process_group, run_capturing_replies,
                                 tiny_config, tiny_run, tiny_simulation)

MLP = {"partition": {"num_clients": 6}, "model": {"name": "mlp", "hidden": [24]}, "train": {"batch_size": 10}}
BN_MODEL = {"model": {"name": "fedbn_cnn", "channels": [4], "hidden": [8]}}
# PCFL on its synthetic task, shrunk (plugins/pcfl/tests/conftest.py): 6 clients, a 4-step flow, every client each
# round; synthetic samples anywhere in a client's own region, so that most clients hold some (sizes 0, 0, 15, 4, 1,
# 15: clients stack by their synthetic batch size, 0, 1, 4 or 10)
PCFL_SINE = {"dataset": {"name": "pcfl_sine", "num_clients": 6, "samples_per_client": 40},
             "partition": {"name": "by_group", "num_clients": 6}, "model": {"name": "mlp", "hidden": [8, 8]},
             "participation": {"join_ratio": 1.0}, "train": {"batch_size": 10, "local_epochs": 2, "lr": 0.05},
             "trainer": {"clusters": 2, "synthetic_region": "own"},
             "aggregator": {"flow_epochs": 4, "setup_block": 2, "flow_hidden": 8, "flow_transforms": 2,
                            "flow_inner_transforms": 2, "flow_join_ratio": 0.5, "flow_batch_size": 20,
                            "flow_lr": 0.01}}

# algorithm -> (config overrides, --set): every algorithm whose trainer the core batches, each checked below
SUPPORTED = {
    "fedavg": ({}, ()),
    "fedavg-momentum-clip-2-epochs": ({}, ("train.momentum=0.9", "train.weight_decay=0.01",
                                           "train.max_grad_norm=0.5", "train.local_epochs=2")),
    "fedavg-adam-drop-last": ({}, ("train.optimizer=adam", "train.lr=0.01", "train.weight_decay=0.001",
                                   "train.drop_last=true")),
    "fedavg-bn-local": (BN_MODEL, ("trainer.bn_stats=local",)),
    "fedper": ({}, ()),
    "fedbn": (BN_MODEL, ()),
    "fedbabu": ({}, ()),
    "lgfedavg": ({}, ()),
    "fedrep": ({}, ("trainer.head_epochs=2",)),
    "fedrep-bn": (BN_MODEL, ("trainer.head_epochs=2", "train.momentum=0.5")),
    "ditto": ({}, ()),
    "fedprox": ({}, ("trainer.mu=0.5", "train.momentum=0.9")),
    "fedcp": ({}, ()),
    "fedcac": ({}, ()),
    "fedntd": ({}, ()),
    "moon": ({}, ()),
    "moon-frozen-train-bn": (BN_MODEL, ("trainer.frozen_mode=train",)),
    "local": ({}, ()),
    "fedsa": ({}, ()),
    # SGD here: a bias before BatchNorm has a gradient of rounding noise only, which Adam would scale up to full steps
    "fedcp-batchnorm-cpn-random-vector": ({}, ("trainer.cpn_norm=batchnorm", "trainer.client_vector_init=random",
                                                "train.momentum=0.9")),
    "ditto-adam-epochs": ({}, ("train.optimizer=adam", "train.lr=0.01", "trainer.personal_epochs=2")),
    "fedc2i": ({}, ()),  # the influence step per client, the training batched (its default: Adam, 2 epochs)
    "fedrod": ({}, ("trainer.personal_lr=0.2",)),  # the personal head with its own learning rate
    "fedrod-momentum": ({}, ("train.momentum=0.9", "trainer.bsm_gamma=0.5")),
    "apfl": ({}, ("trainer.alpha_lr=0.5",)),  # adaptive alpha, a step large enough to move it
    "apfl-fixed-alpha-momentum": ({}, ("trainer.adaptive=false", "train.momentum=0.9")),
    # PCFL over a batched base: the beta term's synthetic batches drawn per client before the steps, passed as inputs
    "pcfl": (PCFL_SINE, ()),  # over Local, its default base
    "pcfl-fedavg-momentum": (PCFL_SINE, ("trainer.base=fedavg", "train.momentum=0.9")),
    "pcfl-fedrep": (PCFL_SINE, ("trainer.base=fedrep", "trainer.head_epochs=2")),
    "pcfl-ditto": (PCFL_SINE, ("trainer.base=ditto",)),
    # every step through vmap (on CPU a step of four clients or fewer otherwise runs plain per-client passes), and
    # through vmap(grad), which stacks of 80 clients or more take
    "pcfl-fedavg-vmap": (PCFL_SINE, ("trainer.base=fedavg",)),
    "pcfl-ditto-vmap-grad": (PCFL_SINE, ("trainer.base=ditto",)),
}


def _algo(name):
    return name.split("-")[0]


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _close(a, b, rel=1e-4, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        if not a.is_floating_point():
            assert torch.equal(a, b), where
            return
        scale = float(a.abs().max()) if a.numel() else 0.0
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        assert diff <= rel * max(scale, 1e-12), f"{where}: differs by {diff:.3g} (scale {scale:.3g})"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], rel, f"{where}/{k}")


def _one_round(tmp_path, name, mode):
    overrides, sets = SUPPORTED[name]
    sim = tiny_simulation(_algo(name), tmp_path / mode, _merge(_merge(MLP, overrides), {"rounds": 1}),
                          sets + (f"clients.batched={mode}",))
    replies = run_capturing_replies(sim)[1]
    states = {cid: sim.backend.get_state(cid) for cid in sim.client_ids}
    return sim, replies, states


def _groups(sim, name):
    """The batched groups one round takes: one, but PCFL's clients stack by their synthetic batch size."""
    if _algo(name) != "pcfl":
        return 1
    size = int(sim.cfg.train.batch_size)
    return len({min(size, len(sim.backend.trainers[cid].syn_y)) for cid in sim.client_ids})


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_one_round_batched_equals_sequential(tmp_path, name, monkeypatch):
    if name.endswith("-vmap") or name.endswith("-vmap-grad"):
        monkeypatch.setattr(B, "SOLO_CLIENTS", 0)
    if name.endswith("-vmap-grad"):
        monkeypatch.setattr(B, "GRAD_TRANSFORM_CLIENTS", 1)
    seq, seq_replies, seq_states = _one_round(tmp_path, name, "off")
    bat, bat_replies, bat_states = _one_round(tmp_path, name, "on")
    assert bat.batched_plan.batched and bat.backend.batched.fallbacks == 0
    assert bat.backend.batched.groups_run == _groups(bat, name)
    assert not seq.batched_plan.batched and seq.backend.batched is None
    assert seq_replies.keys() == bat_replies.keys() == set(seq.client_ids)
    for cid in seq_replies:  # every client's upload and its kept state, to a relative 1e-4
        _close(seq_replies[cid].get("params", {}), bat_replies[cid].get("params", {}), where=f"client {cid} upload")
        _close({k: m.unpack() if hasattr(m, "unpack") else m for k, m in seq_replies[cid].get("mask", {}).items()},
               {k: m.unpack() if hasattr(m, "unpack") else m for k, m in bat_replies[cid].get("mask", {}).items()},
               where=f"client {cid} mask")
        _close(seq_states[cid], bat_states[cid], where=f"client {cid} state")
        assert seq_replies[cid]["num_samples"] == bat_replies[cid]["num_samples"]
        assert bat_replies[cid]["train_loss"] == pytest.approx(seq_replies[cid]["train_loss"], rel=1e-4)
        assert bat_replies[cid].get("metrics", {}) == pytest.approx(seq_replies[cid].get("metrics", {}), rel=1e-4)


DIGITS_30 = {"rounds": 30, "partition": {"num_clients": 8}, "model": {"name": "mlp", "hidden": [100]},
             "train": {"batch_size": 10}, "eval": {"every": 10, "final_k": 1}}


THIRTY = {"fedavg": (), "fedper": (), "fedbabu": (), "lgfedavg": (), "fedrep": ("trainer.head_epochs=2",),
          "ditto": (), "fedprox": ("trainer.mu=0.1",), "fedcp": (), "fedcac": (), "fedntd": (), "moon": (), "local": (), "fedsa": (),
          "fedc2i": ("dataset.name=digits", "partition.name=dirichlet"), "fedrod": (), "apfl": (),
          # with its BatchNorm layers (an MLP has none: FedBN would be FedAvg). iid: on the Dirichlet split this tiny
          # BatchNorm CNN amplifies float rounding -- the sequential run alone ends 1.6 points apart when train.lr
          # moves by 2e-7 of itself (docs/batched-clients.md) -- so no path could be held to 0.3 points there
          "fedbn": ("partition.name=iid",),
          # PCFL(Local) on its shrunk synthetic task (a regression: MSE within 1 % of the sequential run's)
          "pcfl": ()}
THIRTY_OVERRIDES = {"fedbn": {"model": {"name": "fedbn_cnn", "channels": [4], "hidden": [8]}},
                    "pcfl": _merge(PCFL_SINE, {"partition": {"num_clients": 6}})}


# every bundled batched plugin's own tests hold one round of replies and three rounds of scores to its sequential run
# (pflkit.core.testing.assert_batched_matches_sequential); thirty rounds run for four shapes of trainer in every test
# run (one model, two models, a cheap personal head, a regression) and for all of them with PFLKIT_SLOW_TESTS=1
THIRTY_ALWAYS = ("fedavg", "ditto", "fedcac", "pcfl")


@pytest.mark.parametrize("algorithm", [a if a in THIRTY_ALWAYS else pytest.param(a, marks=pytest.mark.slow)
                                       for a in THIRTY])
def test_thirty_digits_rounds_end_within_a_third_of_a_point(tmp_path, algorithm):
    over = _merge(DIGITS_30, THIRTY_OVERRIDES.get(algorithm, {}))
    _, seq = tiny_run(algorithm, tmp_path / "seq", over, THIRTY[algorithm] + ("clients.batched=off",))
    _, bat = tiny_run(algorithm, tmp_path / "bat", over, THIRTY[algorithm] + ("clients.batched=on",))
    assert bat["clients_batched"]["path"] == "batched" and seq["clients_batched"]["path"] == "sequential"
    assert bat["rounds_completed"] == seq["rounds_completed"] == 30
    if seq["metric"] == "accuracy":
        assert abs(bat["final"]["uniform"] - seq["final"]["uniform"]) <= 0.003
    else:
        assert abs(bat["final"]["uniform"] - seq["final"]["uniform"]) <= 0.01 * abs(seq["final"]["uniform"])


def test_every_batched_algorithm_has_its_thirty_round_check():
    assert {_algo(name) for name in SUPPORTED} == set(THIRTY)


def test_third_party_trainer_that_changes_only_its_loss_batches(tmp_path, registries_snapshot):
    class Smoothed(LocalSGDTrainer):  # a plugin of the derivable shape: no batching code of its own
        declares_state = True
        batched_loss_safe = True  # its loss reads only its batch and the model: the one line it needs

        def loss(self, x, y):
            return torch.nn.functional.cross_entropy(self.model(x), y, label_smoothing=0.1)

    registries_snapshot.TRAINERS.register("smoothed", Smoothed)
    over = _merge(MLP, {"rounds": 1, "trainer": {"name": "smoothed"}})
    runs = {}
    for mode in ("off", "on"):
        sim = tiny_simulation("fedavg", tmp_path / mode, over, (f"clients.batched={mode}",))
        runs[mode] = run_capturing_replies(sim)[1]
    assert sim.backend.batched.groups_run == 1
    for cid in runs["off"]:
        _close(runs["off"][cid]["params"], runs["on"][cid]["params"])


# -- the pieces --------------------------------------------------------------------------------------------------------
def test_batch_order_is_the_sequential_one():
    data = TensorData(torch.arange(23.).view(23, 1), torch.arange(23))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    seq = [y for _, y in minibatches(data, 4, 3, generator=g1, drop_last=True)]
    idx = list(batch_indices(23, 4, 3, generator=g2, drop_last=True))
    assert len(seq) == len(idx) == 15 and all(torch.equal(a, b) for a, b in zip(seq, idx))


def test_client_plan_splits_epochs_into_full_batches_and_the_last_one():
    class T:  # what client_plan reads of a trainer
        pass

    t = T()
    t.ctx = type("C", (), {})()
    t.ctx.train = TensorData(torch.zeros(23, 1), torch.zeros(23, dtype=torch.long))
    t.ctx.train_cfg = {"batch_size": 10, "local_epochs": 2, "drop_last": False}
    t.ctx.train_cfg = type("Cfg", (dict,), {"__getattr__": dict.__getitem__})(t.ctx.train_cfg)
    t.ctx.generator = torch.Generator().manual_seed(1)
    plan = B.client_plan(t)
    assert [len(f) for f in plan.full] == [2, 2] and [len(x) for x in plan.last] == [3, 3] and plan.steps == 6
    ref = list(batch_indices(23, 10, 2, generator=torch.Generator().manual_seed(1)))
    flat = [b for e in range(2) for b in plan.full[e] + [plan.last[e]]]
    assert all(torch.equal(a, b) for a, b in zip(flat, ref))


def _cfg(**kw):
    from easydict import EasyDict
    return EasyDict({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "max_grad_norm": None,
                     **kw})


@pytest.mark.parametrize("kw", [{"momentum": 0.9, "weight_decay": 0.01}, {"optimizer": "adam", "weight_decay": 0.01}])
def test_an_idle_client_is_untouched_by_a_step(kw):
    params = {"w": torch.randn(3, 4, 5), "b": torch.randn(3, 5)}
    opt = B.StackedOptimizer(params, _cfg(**kw))
    opt.step({n: torch.randn_like(p) for n, p in params.items()}, None)
    before = {n: p[1].clone() for n, p in params.items()}
    state = {n: (opt.m[n][1].clone(), opt.v[n][1].clone() if opt.v else None) for n in params}
    steps = opt.steps.clone()
    rows = torch.tensor([0, 2])
    opt.step({n: torch.randn(2, *p.shape[1:]) for n, p in params.items()}, rows)
    for n in params:  # client 1 sat this step out: parameters, momentum, Adam moments and step count unchanged
        assert torch.equal(params[n][1], before[n]) and torch.equal(opt.m[n][1], state[n][0])
        if opt.v:
            assert torch.equal(opt.v[n][1], state[n][1])
    assert opt.steps.tolist() == [steps[0] + 1, steps[1], steps[2] + 1]


@pytest.mark.parametrize("kw", [{"momentum": 0.9, "weight_decay": 0.01, "max_grad_norm": 0.3},
                                {"optimizer": "adam", "lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.3}])
def test_stacked_optimizer_equals_one_torch_optimizer_per_client(kw):
    from pflkit.core.api.training import clip_gradients, make_optimizer

    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 2)}
    grads = [{n: torch.randn_like(p) * (i + 1) for n, p in params.items()} for i in range(3)]
    refs = []
    for k in range(4):
        ps = [torch.nn.Parameter(params[n][k].clone()) for n in params]
        opt = make_optimizer(ps, _cfg(**kw))
        for g in grads:
            for p, n in zip(ps, params):
                p.grad = g[n][k].clone()
            clip_gradients(opt)
            opt.step()
        refs.append(ps)
    stacked = B.StackedOptimizer(params, _cfg(**kw))
    for g in grads:
        stacked.step({n: t.clone() for n, t in g.items()}, None)
    for k in range(4):
        for p, n in zip(refs[k], params):
            assert torch.allclose(params[n][k], p.detach(), rtol=1e-5, atol=1e-6)


def test_clients_are_grouped_by_step_count_under_the_bound():
    steps = {0: 9, 1: 2, 2: 8, 3: 3, 4: 9, 5: 1}
    assert B.group_by_steps(steps, None) == [[0, 1, 2, 3, 4, 5]]
    assert B.group_by_steps(steps, 2) == [[1, 5], [2, 3], [0, 4]]


def test_the_cuda_bound_comes_from_free_memory_and_the_key_wins():
    cuda = torch.device("cuda")
    from pflkit.core import BatchedForm, BatchedPhase

    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    loss = lambda x, y: torch.nn.functional.cross_entropy(model(x), y)
    form = BatchedForm({"model": model}, [BatchedPhase(loss, ["model.0.weight"], 1)], lambda losses, start, aux: {})
    need = B.per_client_bytes(form, torch.zeros(10, 64), torch.zeros(10, dtype=torch.long), slots=1)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert need >= params * 4  # parameters, gradient, momentum, working copy at least
    free = lambda device: 100 * need  # a GPU with room for 100 clients' worth
    assert B.stack_bound(None, cuda, lambda: need, free) == 50  # half the free memory
    assert B.stack_bound(None, cuda, lambda: need, lambda d: 10) == 1  # never below one
    assert B.stack_bound(7, cuda, lambda: need, free) == 7  # clients.stack wins
    assert B.stack_bound(None, torch.device("cpu"), lambda: need) is None  # CPU: no bound
    assert B.free_device_memory(torch.device("cpu")) is None


def test_the_runner_groups_a_cuda_round_by_the_memory_bound(tmp_path, monkeypatch):
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1}), ("clients.batched=on",))
    runner = sim.backend.batched
    runner.device = torch.device("cuda")  # as on a GPU: the bound from (stand-in) free memory
    runner.free = lambda device: 2 * 2 * runner_need(sim)  # room for two clients in half of it
    sim.run()
    assert runner._bound == 2 and runner.groups_run == 3


def runner_need(sim):
    t = sim.trainer_cls(sim.contexts[0])
    x, y = t.ctx.train.batch(torch.arange(10))
    return B.per_client_bytes(t.batched_form(), x, y, 1)


# -- the decision ------------------------------------------------------------------------------------------------------
def test_auto_batches_on_cuda_only_and_on_forces_it():
    from pflkit_fedavg import FedAvgTrainer
    from pflkit_fedphp import FedPHPTrainer

    ok = lambda: None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto_cpu = B.decide("auto", FedAvgTrainer, "fedavg", cpu, ok)
    assert not auto_cpu.batched and "CPU" in auto_cpu.reason and "clients.batched=on" in auto_cpu.reason
    assert B.decide("auto", FedAvgTrainer, "fedavg", cuda, ok).batched
    assert B.decide("on", FedAvgTrainer, "fedavg", cpu, ok).batched
    assert not B.decide("off", FedAvgTrainer, "fedavg", cuda, ok).batched
    fedphp = B.decide("auto", FedPHPTrainer, "fedphp", cuda, ok)
    assert not fedphp.batched and "FedPHPTrainer overrides on_fit()" in fedphp.reason
    probe_fails = B.decide("auto", FedAvgTrainer, "fedavg", cuda, lambda: "its training draws random numbers")
    assert not probe_fails.batched and "random" in probe_fails.reason
    with pytest.raises(ConfigError, match="clients.batched=on: trainer 'fedphp' cannot be batched"):
        B.decide("on", FedPHPTrainer, "fedphp", cpu, ok)


def test_dropout_is_found_by_the_probe(tmp_path):
    over = _merge(MLP, {"model": {"dropout": 0.5}, "rounds": 1})
    with pytest.raises(ConfigError, match="random numbers"):
        tiny_simulation("fedavg", tmp_path / "on", over, ("clients.batched=on",))
    sim = tiny_simulation("fedavg", tmp_path / "off", over, ("clients.batched=off",))
    assert "random numbers" in B.probe(sim.trainer_cls(sim.contexts[0]))
    plain = tiny_simulation("fedavg", tmp_path / "plain", MLP, ("clients.batched=off",))
    assert B.probe(plain.trainer_cls(plain.contexts[0])) is None


def test_on_with_a_trainer_that_cannot_batch_is_one_line(tmp_path):
    assert_run_refused("fedphp", ["clients.batched=on"], "cannot be batched", tmp_path)
    assert_run_refused("fedavg", ["clients.batched=sometimes"], "clients.batched", tmp_path)


def test_fedcp_runs_batched_from_the_command_line(tmp_path):
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedcp", "--no-progress", "--set", f"output_dir={tmp_path}",
                                   "--set", "run_name=cp", "--set", "rounds=2", "--set", "partition.num_clients=4",
                                   "--set", "clients.batched=on", "--set", "device=cpu"])
    assert res.exit_code == 0, res.output
    assert "batched (clients.batched=on)" in res.output
    assert json.loads((tmp_path / "cp" / "summary.json").read_text())["clients_batched"]["path"] == "batched"


def test_fl_show_says_which_path():
    out = CliRunner().invoke(cli, ["show", "fedavg"]).output
    assert "clients.batched: batched" in out
    assert "clients.batched: batched (FedCPTrainer declares its phases)" in CliRunner().invoke(
        cli, ["show", "fedcp"]).output
    assert "clients.batched: batched (FedRepTrainer declares its phases)" in CliRunner().invoke(
        cli, ["show", "fedrep"]).output
    out = CliRunner().invoke(cli, ["show", "fedphp"]).output
    assert "clients.batched: sequential (FedPHPTrainer overrides" in out and "declares no batched_form()" in out


def test_fl_show_pcfl_says_over_which_bases_it_batches():
    out = CliRunner().invoke(cli, ["show", "pcfl"]).output
    assert "clients.batched: batched (PcflClientMixin around LocalTrainer's phases)" in out
    line = next(ln for ln in out.splitlines() if "clients.batched over each" in ln)
    assert "batched over apfl, ditto, fedavg," in line and "local;" in line
    assert "sequential over perfedavg (PerFedAvgTrainer overrides local_update()" in line and "pfedme (" in line


def test_pcfl_over_a_base_that_cannot_batch_is_refused_with_the_reason(tmp_path):
    assert_run_refused("pcfl", ["clients.batched=on", "trainer.base=pfedme"],
                       "PFedMeTrainer overrides local_update() and declares no batched_form()", tmp_path)


def test_a_wrapper_form_covers_only_what_the_wrapper_overrides():
    class Base(LocalSGDTrainer):
        def local_update(self):  # a fit path of its own, no form: it cannot batch
            return super().local_update()

    class Wrapper:
        batched_wraps = True

        def batched_form(self):
            return super().batched_form()

    assert B.form_reason(type("W[LocalSGDTrainer]", (Wrapper, LocalSGDTrainer), {})) is None
    assert "Base overrides local_update()" in B.form_reason(type("W[Base]", (Wrapper, Base), {}))
    plain = type("Plain", (), {"batched_form": Wrapper.batched_form})  # the same form without batched_wraps
    assert "overrides" in B.form_reason(type("P[LocalSGDTrainer]", (plain, LocalSGDTrainer),
                                             {"local_update": LocalSGDTrainer.local_update}))


def test_run_info_and_summary_say_which_path_ran(tmp_path):
    res = CliRunner().invoke(cli, ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}",
                                   "--set", "run_name=r", "--set", "rounds=1", "--set", "model.name=mlp",
                                   "--set", "partition.num_clients=3", "--set", "device=cpu"])
    assert res.exit_code == 0, res.output
    assert "clients trained" in res.output and "sequential (auto: one client after another on CPU; clients.batched=on batches them)" in res.output
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())["entries"][0]["clients_batched"]
    assert info["mode"] == "auto" and info["path"] == "sequential"
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["clients_batched"]["path"] == "sequential"


# -- what keeps working ------------------------------------------------------------------------------------------------
ON = ("clients.batched=on",)


def test_a_diverging_client_is_rejected_alone(tmp_path):
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1}), ON)
    sim.contexts[2].train.x[0] = float("nan")  # client 2's own data makes its own slice NaN
    res = sim.run()
    assert sim.backend.batched.groups_run == 1
    assert [f["client"] for f in sim.failures] == [2] and "NaN" in sim.failures[0]["reason"]
    assert res["client_failures"] == 1


def test_a_group_that_raises_runs_again_one_client_at_a_time(tmp_path, monkeypatch):
    seq = tiny_simulation("fedavg", tmp_path / "seq", _merge(MLP, {"rounds": 1}), ("clients.batched=off",))
    seq_replies = run_capturing_replies(seq)[1]
    sim = tiny_simulation("fedavg", tmp_path / "bat", _merge(MLP, {"rounds": 1}), ON)

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(B, "train_stacked", broken)
    replies = run_capturing_replies(sim)[1]
    assert sim.backend.batched.fallbacks == 1 and sim.backend.batched.groups_run == 0 and not sim.failures
    for cid in seq_replies:  # the sequential numbers, exactly
        for k, v in seq_replies[cid]["params"].items():
            assert torch.equal(v, replies[cid]["params"][k])


def test_a_client_whose_state_cannot_be_swapped_in_fails_alone(tmp_path, registries_snapshot):
    class Fragile(LocalSGDTrainer):
        declares_state = True

        def load_client_state(self, state):
            if self.ctx.cid == 1:
                raise ValueError("corrupt state")
            super().load_client_state(state)

    registries_snapshot.TRAINERS.register("fragile", Fragile)
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1, "trainer": {"name": "fragile"}}), ON)
    sim.run()
    assert sim.backend.batched.groups_run == 1
    fit = [f for f in sim.failures if f["kind"] == "fit"]
    assert [f["client"] for f in fit] == [1] and "corrupt state" in fit[0]["reason"]


def test_a_group_past_its_time_limit_runs_again_one_client_at_a_time(tmp_path, monkeypatch):
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1}), ON + ("failures.client_timeout=0.2",))
    real = B.train_stacked

    def slow(*a, **k):
        time.sleep(3)  # past 0.2 s x 6 clients
        return real(*a, **k)

    monkeypatch.setattr(B, "train_stacked", slow)
    res = sim.run()
    assert sim.backend.batched.fallbacks == 1 and res["client_failures"] == 0


def test_every_batched_reply_passes_the_privacy_guard(tmp_path):
    sim = tiny_simulation("fedavg", tmp_path, _merge(MLP, {"rounds": 1}), ON)
    seen = []
    original = sim.guard.violation

    def violation(cid, reply):  # the guard refuses client 3's upload (as if it carried raw samples)
        if isinstance(reply, dict) and "params" in reply:
            seen.append(cid)
            if cid == 3:
                return "reply field 'params' holds training samples"
        return original(cid, reply)

    sim.guard.violation = violation
    sim.run()
    assert sorted(seen) == sim.client_ids and sim.backend.batched.groups_run == 1
    assert [(f["client"], f["kind"]) for f in sim.failures] == [(3, "fit")]


def test_resume_of_a_batched_run(tmp_path):
    assert_resume_matches_full_run("fedper", _merge(MLP, {"rounds": 3}), tmp_path, ON)


def test_streaming_aggregation_of_a_batched_round(tmp_path):
    assert_streaming_matches_all_replies("fedavg", MLP, tmp_path, ON)


def test_spilled_and_live_client_states_give_the_pooled_numbers(tmp_path):
    over = _merge(MLP, {"rounds": 2})
    _, pooled = tiny_run("fedper", tmp_path / "pooled", over, ON)
    spilled, spilled_res = tiny_run("fedper", tmp_path / "spilled", over, ON + ("clients.state_memory=1000",))
    live, live_res = tiny_run("fedper", tmp_path / "live", over, ON, backend=OneTrainerPerClient())
    assert spilled.backend.pool.store.spills > 0 and live.backend.pool is None
    assert spilled.backend.batched.groups_run == live.backend.batched.groups_run == 2
    assert pooled["final"] == spilled_res["final"] == live_res["final"]


def test_each_rank_batches_its_own_clients(tmp_path):
    from pflkit.core.distributed.backend import DistributedBackend

    with one_process_group():
        sim, res = tiny_run("fedavg", tmp_path / "dist", _merge(MLP, {"rounds": 2}), ON,
                            backend=DistributedBackend())
        assert sim.backend.inner.batched is sim.backend.batched and sim.backend.batched.groups_run == 2
    _, serial = tiny_run("fedavg", tmp_path / "serial", _merge(MLP, {"rounds": 2}), ON)
    assert res["final"] == serial["final"]
