"""The general core mechanisms PCFL needed, tested with toy components: composition of an algorithm that augments
another (core/engine/compose.py) and the resumable set-up phase (``setup_steps``, Simulation._run_setup)."""
import json

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import Algorithm, ClientTrainer, ConfigError, LocalSGDTrainer, Message, Param, Simulation
from pflkit.core.testing import cli, composition, parse_sets, resolve, tiny_config
from pflkit_fedavg import FedAvgAggregator, FedAvgTrainer
from pflkit_fedrep import FedRepTrainer


class _ScaleMixin:
    """A toy augmentation: multiplies the personal model's data loss and counts the calls."""

    def data_loss(self, model, x, y):
        if model is self.personal_forward():
            self.calls = getattr(self, "calls", 0) + 1
        return super().data_loss(model, x, y) * self.ctx.hp.scale


class ScaledTrainer(ClientTrainer):
    """Wrapper: scales the base's objective."""

    params = {"scale": Param(1.0, "loss multiplier")}
    default_base = "fedavg"

    @classmethod
    def can_wrap(cls, base):
        return None if issubclass(base, LocalSGDTrainer) and base.protocol == "global-model" else "not global-model"

    @classmethod
    def wrap(cls, base):
        return type(f"Scaled[{base.__name__}]", (_ScaleMixin, base),
                    {"params": {**base.params, **cls.params}, "protocol": base.protocol})


@pytest.fixture
def scaled(registries_snapshot):
    reg = registries_snapshot
    reg.TRAINERS.register("scaled", ScaledTrainer)
    reg.ALGORITHMS.register("scaled", Algorithm(trainer="scaled", aggregator="fedavg",
                                                defaults={"trainer": {"scale": 2.0}, "train": {"local_epochs": 2}}))
    return reg


def test_base_params_and_defaults_apply_beneath_the_wrapper(scaled):
    cfg = tiny_config("scaled", {"train": {"local_epochs": 3}}, sets=("trainer.base=fedrep",))
    assert cfg.trainer.base == "fedrep"
    assert cfg.trainer.head_epochs == 10      # FedRep's algorithm default, beneath the wrapper's
    assert cfg.trainer.scale == 2.0           # the wrapping algorithm's own default
    assert cfg.train.local_epochs == 3        # the user's value above both
    cfg = tiny_config("scaled", sets=("trainer.base=fedrep", "trainer.head_epochs=4"))
    assert cfg.trainer.head_epochs == 4
    # without the TINY overrides: core < fedrep (lr 0.05, 1 local epoch, cnn4) < scaled (2 local epochs)
    full = resolve([parse_sets(["trainer.base=fedrep"])], algorithm="scaled")
    assert full.train.local_epochs == 2 and full.model.name == "cnn4"
    with pytest.raises(ConfigError, match="unknown key 'trainer.head_epochs'"):
        tiny_config("scaled", sets=("trainer.head_epochs=4",))  # base fedavg has no head_epochs


def test_simulation_builds_the_composed_classes(scaled, tmp_path):
    cfg = tiny_config("scaled", sets=("trainer.base=fedrep", "rounds=1", "trainer.head_epochs=1"))
    sim = Simulation(cfg, run_dir=tmp_path / "run", tensorboard=False)
    assert issubclass(sim.trainer_cls, FedRepTrainer) and issubclass(sim.trainer_cls, _ScaleMixin)
    assert sim.trainer_cls is composition(cfg).trainer  # one class per (wrapper, base)
    assert sim.aggregator_cls is FedAvgAggregator
    assert sim.server_ctx.shared_keys and all(k.startswith("features.") for k in sim.server_ctx.shared_keys)
    sim.run()
    assert all(getattr(t, "calls", 0) > 0 for t in sim.backend.trainers.values() if t.ctx.cid in (0, 1, 2, 3))


def test_the_scale_really_changes_the_objective(scaled, tmp_path):
    def final(scale):
        cfg = tiny_config("scaled", sets=("rounds=1", f"trainer.scale={scale}"))
        return Simulation(cfg, run_dir=tmp_path / f"s{scale}", tensorboard=False).run()["final"]["uniform"]

    plain = tiny_config("fedavg", sets=("rounds=1",))
    baseline = Simulation(plain, run_dir=tmp_path / "plain", tensorboard=False).run()["final"]["uniform"]
    assert final(1.0) == baseline  # scale 1: bit-for-bit the base algorithm
    assert final(3.0) != baseline


def test_bad_bases_are_one_clear_line(scaled):
    with pytest.raises(ConfigError, match=r"trainer.base: unknown algorithm 'fedavgg'.*Did you mean 'fedavg'.*"
                                          r"can wrap: .*fedavg"):
        tiny_config("scaled", sets=("trainer.base=fedavgg",))
    with pytest.raises(ConfigError, match=r"cannot wrap 'local': not global-model\. Bases it can wrap: .*fedrep"):
        tiny_config("scaled", sets=("trainer.base=local",))
    with pytest.raises(ConfigError, match="cannot wrap 'scaled': it is itself an augmenting algorithm"):
        tiny_config("scaled", sets=("trainer.base=scaled",))


def test_fl_show_lists_the_composed_options(scaled):
    res = CliRunner().invoke(cli, ["show", "scaled"])
    assert res.exit_code == 0, res.output
    assert "over trainer 'fedavg' of base algorithm 'fedavg'" in res.output
    assert "trainer.scale = 2.0" in res.output and "trainer.base = 'fedavg'" in res.output
    assert "trainer.bn_stats" in res.output  # the base trainer's declared option
    assert "base algorithms it can wrap" in res.output


# -- resumable set-up ------------------------------------------------------------------------------------------
class ProbeTrainer(FedAvgTrainer):
    def on_probe(self, payload):
        return {"r": float(torch.rand(1, generator=self.ctx.generator))}


class StepAggregator(FedAvgAggregator):
    """Set-up in resumable steps: each asks every client for a random number (seeded by the core)."""

    params = {"steps": Param(3, "set-up steps")}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.done, self.seen = 0, []

    def setup_steps(self, comm):
        while self.done < self.ctx.hp.steps:
            replies = comm.send({c: Message("probe") for c in comm.client_ids})
            self.seen.append([replies[c]["r"] for c in sorted(replies)])
            self.done += 1
            yield "probe"

    def state_dict(self):
        return {"base": super().state_dict(), "done": self.done, "seen": [list(s) for s in self.seen]}

    def load_state_dict(self, state):
        super().load_state_dict(state["base"])
        self.done, self.seen = int(state["done"]), [list(s) for s in state["seen"]]


@pytest.fixture
def stepper(registries_snapshot):
    reg = registries_snapshot
    reg.TRAINERS.register("probe", ProbeTrainer)
    reg.AGGREGATORS.register("stepagg", StepAggregator)
    reg.ALGORITHMS.register("stepper", Algorithm(trainer="probe", aggregator="stepagg"))
    return reg


def _stepper_cfg(steps=3):
    return tiny_config("stepper", {"checkpoint": {"every": 1}}, sets=(f"aggregator.steps={steps}",))


def test_setup_steps_resume_with_the_same_seeds_and_numbers(stepper, tmp_path):
    whole = Simulation(_stepper_cfg(), run_dir=tmp_path / "whole", tensorboard=False)
    ref = whole.run()
    for pause in (1, 2, 3):
        run_dir = tmp_path / f"pause{pause}"
        first = Simulation(_stepper_cfg(), run_dir=run_dir, tensorboard=False).run(stop_in_setup=pause)
        assert first["interrupted"] and first["rounds_completed"] == 0
        sim = Simulation.resume(run_dir, tensorboard=False)
        assert sim.server.done == pause and not sim.setup_done
        out = sim.run()
        assert sim.server.seen == whole.server.seen  # the clients drew the same numbers after the resume
        assert out["final"] == ref["final"] and out["bytes_up_total"] == ref["bytes_up_total"]
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in lines] == [1, 2]


def test_setup_traffic_counts_in_the_totals(stepper, tmp_path):
    none = Simulation(_stepper_cfg(0), run_dir=tmp_path / "a", tensorboard=False).run()
    three = Simulation(_stepper_cfg(3), run_dir=tmp_path / "b", tensorboard=False).run()
    # 3 steps x 4 clients x one float (8 bytes) up; the probe messages are empty
    assert three["bytes_up_total"] - none["bytes_up_total"] == 3 * 4 * 8
    assert three["bytes_down_total"] == none["bytes_down_total"]
