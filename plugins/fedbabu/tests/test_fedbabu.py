"""FedBABU: body-only FedAvg with the head frozen at its initialisation (bit for bit), fine-tuning a scratch copy at
evaluation without touching training, pooled = one trainer per client, resume, two processes = serial, bad input."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from pflkit.core import MODELS, TRAINERS, Simulation, make_optimizer, run_sgd
from pflkit.core.backend import SerialBackend
from pflkit.core.cli.main import cli
from pflkit.core.clientstate import same_state
from pflkit.core.config import to_plain
from pflkit.core.testing import run_capturing_replies, tiny_config
from pflkit_fedavg import FedAvgTrainer
from pflkit_fedbabu import FedBABUTrainer

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}
FT = ("eval.adapt_epochs=1",)  # one fine-tuning epoch keeps the tests fast


class OneTrainerPerClient(SerialBackend):
    """One live trainer per client whatever the trainer declares: the reference for pooled runs."""

    def start(self, build_trainer, client_ids, state_options=None):
        super().start(lambda cid: build_trainer(cid), client_ids)


class BodyOnlyFedAvg(FedAvgTrainer):
    """The reference: FedAvg that shares the body only and whose optimiser holds the body only (head lr 0)."""

    @classmethod
    def shared_keys(cls, model, hp):
        return [k for k in super().shared_keys(model, hp) if not k.startswith("head.")]

    def local_update(self):
        self.model.train()
        return run_sgd(self.batches(), self.loss,
                       make_optimizer(self.model.features.parameters(), self.ctx.train_cfg))


def _no_head(input_shape, num_classes, **_):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


@pytest.fixture
def registered():
    """Register the test's trainer and model in this process, and forget them afterwards."""
    from pflkit.core import registry as reg

    for r in reg.ALL_REGISTRIES.values():
        r._discover()
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items()}
    TRAINERS.register("fedbabu_test_body_only", BodyOnlyFedAvg)
    MODELS.register("fedbabu_test_nohead", _no_head)
    yield
    for k, r in reg.ALL_REGISTRIES.items():
        r._entries = before[k]


def records(run_dir, drop=()):
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if "seconds" not in k and not any(d in k for d in drop)})
    return out


def simulation(tmp_path, name, algorithm="fedbabu", sets=FT, **kw):
    return Simulation(tiny_config(algorithm, OVER, sets), run_dir=tmp_path / name, tensorboard=False, **kw)


def test_without_fine_tuning_it_is_body_only_fedavg_with_a_frozen_head(tmp_path, registered):
    babu = simulation(tmp_path, "babu", sets=("eval.adapt=never",))
    got = run_capturing_replies(babu)
    ref = simulation(tmp_path, "ref", "fedavg", sets=("trainer.name=fedbabu_test_body_only",))
    want = run_capturing_replies(ref)
    assert records(tmp_path / "babu") == records(tmp_path / "ref")
    for rnd in want:  # every upload, bit for bit: the body only
        for cid in want[rnd]:
            assert same_state(got[rnd][cid]["params"], want[rnd][cid]["params"])
            assert not any(k.startswith("head.") for k in got[rnd][cid]["params"])
    head0 = babu.build_model().head.state_dict()
    for cid in babu.client_ids:  # the head never moved from the common random initialisation
        trainer = babu.backend.trainers[cid]
        assert same_state(trainer.model.head.state_dict(), head0)
        assert not any(p.requires_grad for p in trainer.model.head.parameters())
    assert set(babu.server.global_state) == {k for k in babu.build_model().state_dict() if k.startswith("features.")}


def test_fine_tuning_at_evaluation_changes_scores_not_training(tmp_path):
    plain = simulation(tmp_path, "plain", sets=("eval.adapt=never",))
    plain_up = run_capturing_replies(plain)
    tuned = simulation(tmp_path, "tuned")
    tuned_up = run_capturing_replies(tuned)
    for rnd in plain_up:
        for cid in plain_up[rnd]:
            assert same_state(tuned_up[rnd][cid]["params"], plain_up[rnd][cid]["params"])
    a, b = records(tmp_path / "tuned"), records(tmp_path / "plain")
    steps = sum(-(-len(tuned.data.splits[c].train) // 32) for c in tuned.client_ids)  # one epoch, batch 32
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == rb["train_loss"]
        assert ra["accuracy/uniform"] > rb["accuracy/uniform"]  # a random head scores poorly until fine-tuned
        assert ra["adapt/steps"] == steps and ra["adapt/clients"] == 4
    assert tuned.cfg.eval.adapt_params == "all"


def test_fedbabu_defaults_are_the_papers_protocol():
    cfg = tiny_config("fedbabu")
    assert (cfg.eval.adapt, cfg.eval.adapt_epochs, cfg.eval.adapt_steps, cfg.eval.adapt_params) == \
        ("every", 5, None, "all")
    assert cfg.aggregator.weighting == "samples"


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled = simulation(tmp_path, "pooled")
    pooled.run()
    legacy = simulation(tmp_path, "legacy", backend=OneTrainerPerClient())
    legacy.run()
    assert pooled.backend.pool is not None and legacy.backend.pool is None
    assert records(tmp_path / "pooled") == records(tmp_path / "legacy")
    assert len(pooled.backend.pool.store) == 0  # the frozen head equals the initial state: nothing is stored


def test_resume_reaches_the_same_numbers(tmp_path):
    full = simulation(tmp_path, "full").run()
    simulation(tmp_path, "part").run(stop_after=2)
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == 3 and resumed["final"] == full["final"]
    assert records(tmp_path / "part") == records(tmp_path / "full")


@pytest.mark.parametrize("sets, message", [
    (("model.name=fedbabu_test_nohead",), "has no 'head' sub-module"),
    (("eval.adapt_steps=3",), "eval.adapt_steps (3) and eval.adapt_epochs (5) are both set"),
    (("eval.adapt_params=tail",), "eval.adapt_params: 'tail' is not a parameter set of trainer 'fedbabu'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message, registered):
    args = ["run", "--plugin", "fedbabu", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "rounds=1"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.output, res.output
    assert not any(tmp_path.iterdir())  # a failed start leaves nothing behind


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    cfg = tiny_config("fedbabu", OVER, FT)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(to_plain(cfg)))
    cmd = [sys.executable, "-m", "pflkit.core.cli", "run", "--workers", "2", "--no-progress", "--config", str(path),
           "--set", f"output_dir={tmp_path}", "--set", "run_name=w2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFLKIT_RENDEZVOUS_TIMEOUT": "60", "PFLKIT_DIST_TIMEOUT": "120"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    simulation(tmp_path, "serial").run()
    assert records(tmp_path / "w2") == records(tmp_path / "serial")
