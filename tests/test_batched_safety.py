"""Batched clients never change a result silently (issue 36, HIGH 1). Four plugins whose batched numbers differed
from their sequential ones with exit 0 and no warning: a class-balanced loss with weights from the client's labels
(computed in ``__init__``), a loss scaled by the client id read from ``self.ctx``, a penalty over parameters kept
aside in a list, and a declared phase of -3 epochs. Now: a subclass that changes the loss batches only where it
declares the loss batch-safe; every batched run checks one step stacked against one client at a time before it
trusts the stack (``on``: one line, exit 2; ``auto``: one client after another, said once); a phase's fields are
validated."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pflkit.core import BatchedForm, BatchedPhase, ConfigError, LocalSGDTrainer, trained_names
from pflkit.core.api.batching import BatchedFormError
from pflkit.core.engine.batched import form_reason
from pflkit.core.testing import assert_run_refused, metrics_records, tiny_run, tiny_simulation

MLP = {"rounds": 2, "partition": {"num_clients": 4}, "model": {"name": "mlp", "hidden": [16]},
       "train": {"batch_size": 16, "local_epochs": 1}}


class ClassBalanced(LocalSGDTrainer):
    """Weights from the client's own label counts, computed in __init__: per-client state the stack never sees."""

    batched_loss_safe = True  # a wrong promise: the self-check must catch it

    def __init__(self, ctx):
        super().__init__(ctx)
        counts = torch.bincount(ctx.train.y, minlength=ctx.task.output_dim).float()
        self.weights = counts.sum() / (counts.clamp(min=1) * len(counts))

    def loss(self, x, y):
        return F.cross_entropy(self.model(x), y, weight=self.weights)


class ByClientId(LocalSGDTrainer):
    batched_loss_safe = True  # wrong

    def loss(self, x, y):
        return super().loss(x, y) * (1 + 3 * self.ctx.cid)


class ListAside(LocalSGDTrainer):
    batched_loss_safe = True  # wrong: the stack substitutes tensors into the modules, not into this list

    def __init__(self, ctx):
        super().__init__(ctx)
        self.aside = list(self.model.parameters())

    def loss(self, x, y):
        return super().loss(x, y) + 0.5 * sum((p ** 2).sum() for p in self.aside)


class NegativeEpochs(LocalSGDTrainer):
    def batched_form(self):
        phase = BatchedPhase(self.loss, trained_names(self.model, "model"), -3)
        return BatchedForm({"model": self.model}, [phase], lambda losses, start, aux: {})


WRONG = {"classbalanced": ClassBalanced, "byclientid": ByClientId, "listaside": ListAside}


@pytest.fixture
def registered(registries_snapshot):
    for name, cls in {**WRONG, "negativeepochs": NegativeEpochs}.items():
        registries_snapshot.TRAINERS.register(name, cls)
    return registries_snapshot


@pytest.mark.parametrize("name", sorted(WRONG))
def test_batched_on_refuses_a_stack_that_differs_from_one_client_at_a_time(tmp_path, registered, name):
    from click.testing import CliRunner
    from pflkit.core.testing import cli
    args = ["run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path / 'out'}"]
    for s in (f"trainer.name={name}", "clients.batched=on", "model.name=mlp", "model.hidden=[16]", "rounds=1",
              "partition.num_clients=4", "train.batch_size=16"):
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert "batching would change this trainer's numbers" in errors[0] and WRONG[name].__name__ in errors[0]


@pytest.mark.parametrize("name", sorted(WRONG))
def test_batched_auto_falls_back_to_one_client_at_a_time_and_says_so(tmp_path, registered, name, caplog):
    over = {**MLP, "trainer": {"name": name}}
    _, seq = tiny_run("fedavg", tmp_path / "seq", over, ("clients.batched=off",))
    sim = tiny_simulation("fedavg", tmp_path / "auto", over, ("clients.batched=on",))
    sim.backend.batched.plan.mode = "auto"  # auto batches on CUDA only: the same runner, as auto would build it there
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        summary = sim.run()
    warnings = [r for r in caplog.records if "training one client after another" in r.getMessage()]
    assert len(warnings) == 1 and WRONG[name].__name__ in warnings[0].getMessage()
    assert summary["clients_batched"]["path"] == "sequential" and "self-check" in summary["clients_batched"]["reason"]
    assert sim.backend.batched.groups_run == 0
    keys = ("accuracy/uniform", "accuracy/weighted", "train_loss")
    assert [{k: r.get(k) for k in keys} for r in metrics_records(tmp_path / "auto" )] == \
        [{k: r.get(k) for k in keys} for r in metrics_records(tmp_path / "seq")]


def test_a_negative_epoch_count_is_one_line(tmp_path, registered):
    with pytest.raises(BatchedFormError, match=r"BatchedPhase.epochs: -3 is invalid: must be a count >= 0"):
        BatchedPhase(lambda x, y: x, ["model.w"], -3)
    (tmp_path / "out").mkdir()
    assert_run_refused("fedavg", ["trainer.name=negativeepochs", "clients.batched=on", "model.name=mlp"],
                       "BatchedPhase.epochs: -3 is invalid", tmp_path / "out")


@pytest.mark.parametrize("kwargs, words", [
    ({"epochs": 1.5}, "BatchedPhase.epochs: 1.5 is invalid"),
    ({"epochs": True}, "BatchedPhase.epochs: True is invalid"),
    ({"epochs": 1, "lr": float("nan")}, "BatchedPhase.lr: nan is invalid: must be a finite number > 0"),
    ({"epochs": 1, "lr": -0.1}, "BatchedPhase.lr: -0.1 is invalid"),
    ({"epochs": 1, "batch_size": 0}, "BatchedPhase.batch_size: 0 is invalid"),
    ({"epochs": 1, "lrs": {"model.w": float("inf")}}, "BatchedPhase.lrs['model.w']: inf is invalid"),
])
def test_phase_fields_are_validated(kwargs, words):
    with pytest.raises(BatchedFormError, match=words.replace("[", r"\[").replace("]", r"\]")):
        BatchedPhase(lambda x, y: x, ["model.w"], **kwargs)


def test_a_form_that_is_not_a_batched_form_is_one_line(tmp_path, registries_snapshot):
    class Wrong(LocalSGDTrainer):
        def batched_form(self):
            return {"modules": {}}

    registries_snapshot.TRAINERS.register("wrongform", Wrong)
    (tmp_path / "out").mkdir()
    assert_run_refused("fedavg", ["trainer.name=wrongform", "clients.batched=on", "model.name=mlp"],
                       "batched_form() returns dict, not a BatchedForm", tmp_path / "out")
    with pytest.raises(BatchedFormError, match="BatchedForm.phases"):
        BatchedForm({"model": torch.nn.Linear(2, 2)}, ["not a phase"], lambda *a: {})


def test_an_undeclared_loss_runs_sequentially_and_fl_show_says_why(registries_snapshot):
    class Undeclared(LocalSGDTrainer):
        def loss(self, x, y):
            return super().loss(x, y)

    class Declared(Undeclared):
        batched_loss_safe = True

        def loss(self, x, y):
            return super().loss(x, y)

    assert "Undeclared overrides loss() without declaring it batch-safe" in form_reason(Undeclared)
    assert form_reason(Declared) is None
    registries_snapshot.TRAINERS.register("undeclared", Undeclared)
    from click.testing import CliRunner
    from pflkit.core.testing import cli
    registries_snapshot.ALGORITHMS.register("undeclared_algo", type(registries_snapshot.ALGORITHMS.get("fedavg"))(
        trainer="undeclared", aggregator="fedavg", description="test"))
    out = CliRunner().invoke(cli, ["show", "undeclared_algo"]).output
    assert "sequential (Undeclared overrides loss() without declaring it batch-safe" in out


def test_the_self_check_passes_an_honest_trainer_and_keeps_its_numbers(tmp_path):
    sim, _ = tiny_run("fedavg", tmp_path / "on", MLP, ("clients.batched=on",))
    assert sim.backend.batched.verified and sim.backend.batched.groups_run == 2


# -- pflkit.core.testing.assert_batched_matches_sequential: the check every batched plugin's tests run ---------------
def test_the_plugin_helper_catches_a_batched_path_that_differs(tmp_path, monkeypatch):
    from pflkit.core.engine import batched as B
    from pflkit.core.testing import assert_batched_matches_sequential

    real = B.train_stacked

    def perturbed(*args, **kwargs):  # the stack's result for its last client nudged: what a subtle bug would do
        states, losses, aux = real(*args, **kwargs)
        states[-1] = {n: t + 1e-2 if t.is_floating_point() else t for n, t in states[-1].items()}
        return states, losses, aux

    monkeypatch.setattr(B, "train_stacked", perturbed)
    with pytest.raises(AssertionError, match="batched and sequential differ by"):
        assert_batched_matches_sequential("fedavg", MLP, tmp_path)


def test_the_plugin_helper_refuses_a_plugin_that_does_not_batch(tmp_path):
    from pflkit.core.testing import assert_batched_matches_sequential

    with pytest.raises(Exception, match="cannot be batched|did not batch"):
        assert_batched_matches_sequential("fedala", MLP, tmp_path)
