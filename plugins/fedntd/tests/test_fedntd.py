"""FedNTD: beta 0 is FedAvg bit for bit, the distillation target is the received model, declared state (pooled =
one trainer per client), resume, two processes = serial, and bad input as one line + exit 2."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import Simulation
from pflkit.core.backend import SerialBackend
from pflkit.core.cli.main import cli
from pflkit.core.config import to_plain
from pflkit.core.testing import tiny_config
from pflkit_fedntd import FedNTDTrainer

OVER = {"rounds": 3, "participation": {"join_ratio": 0.5}}


class OneTrainerPerClient(SerialBackend):
    """One live trainer per client whatever the trainer declares: the reference for pooled runs."""

    def start(self, build_trainer, client_ids, state_options=None):
        super().start(lambda cid: build_trainer(cid), client_ids)


def records(run_dir, drop=()):
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if "seconds" not in k and not any(d in k for d in drop)})
    return out


def run(tmp_path, name, algorithm="fedntd", sets=(), **kw):
    sim = Simulation(tiny_config(algorithm, OVER, sets), run_dir=tmp_path / name, tensorboard=False, **kw)
    return sim, sim.run()


def test_beta_zero_is_fedavg_bit_for_bit(tmp_path):
    ntd, a = run(tmp_path, "ntd", sets=("trainer.beta=0",))
    avg, b = run(tmp_path, "avg", "fedavg")
    assert a["final"] == b["final"] and a["best"] == b["best"]
    # every record equal but the extra metric, whose 8 bytes per reply the upload counter includes
    assert records(tmp_path / "ntd", drop=("ntd_loss", "bytes_up")) == records(tmp_path / "avg", drop=("bytes_up",))
    assert [r["bytes_up"] - 8 * r["clients_replied"] for r in records(tmp_path / "ntd")] == \
        [r["bytes_up"] for r in records(tmp_path / "avg")]
    for k, v in avg.server.global_state.items():
        assert torch.equal(ntd.server.global_state[k], v), k
    # ... while the default beta changes the training
    on, _ = run(tmp_path, "on")
    assert any(not torch.equal(on.server.global_state[k], v) for k, v in avg.server.global_state.items())
    assert all(r["clients/ntd_loss"] > 0 for r in records(tmp_path / "on") if "train_loss" in r)


def test_distillation_target_is_the_received_model_frozen(tmp_path):
    sim = Simulation(tiny_config("fedntd", OVER), run_dir=tmp_path / "r", tensorboard=False)
    trainer = FedNTDTrainer(sim.contexts[1])
    w_t = {k: v.clone() for k, v in sim.server.global_state.items()}
    reply = trainer.on_fit({"params": w_t})
    for k, v in trainer.global_model.state_dict().items():
        assert torch.equal(v, w_t[k]), k  # the frozen copy is w^t, untouched by the local steps
    assert any(not torch.equal(reply["params"][k], w_t[k]) for k in w_t)
    assert not any(p.requires_grad for p in trainer.global_model.parameters())


def test_pooled_equals_one_trainer_per_client(tmp_path):
    pooled, a = run(tmp_path, "pooled")
    legacy, b = run(tmp_path, "legacy", backend=OneTrainerPerClient())
    assert pooled.backend.pool is not None and legacy.backend.pool is None
    assert records(tmp_path / "pooled") == records(tmp_path / "legacy") and a["final"] == b["final"]


def test_resume_reaches_the_same_numbers(tmp_path):
    _, full = run(tmp_path, "full")
    Simulation(tiny_config("fedntd", OVER), run_dir=tmp_path / "part", tensorboard=False).run(stop_after=2)
    resumed = Simulation.resume(tmp_path / "part", tensorboard=False).run()
    assert resumed["rounds_completed"] == 3 and resumed["final"] == full["final"]
    assert records(tmp_path / "part") == records(tmp_path / "full")


@pytest.mark.parametrize("sets, message", [
    (("trainer.beta=-1",), "trainer.beta: -1.0 is invalid: must be >= 0"),
    (("trainer.tau=0",), "trainer.tau: 0.0 is invalid: must be > 0"),
    (("dataset.name=pcfl_sine", "model.name=mlp"), "not-true distillation needs a classification task"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, message):
    args = ["run", "--plugin", "fedntd", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "rounds=1"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert sum(ln.startswith("Error") for ln in res.output.splitlines()) == 1
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # a failed start leaves no run folder behind


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_two_workers_give_the_serial_numbers(tmp_path):
    cfg = tiny_config("fedntd", OVER)
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
    run(tmp_path, "serial")
    assert records(tmp_path / "w2") == records(tmp_path / "serial")
