"""Issue 29, records: a run that fails (or is stopped) during its rounds keeps its record and says why; a start that
fails before round 1 leaves nothing behind (not even the output folder it created); spill files go after a clean
finish; the Medium inputs (an empty client split, endless adaptation, huge models, bad plugin names, a full disk
under fl new-plugin) are one line and exit 2.

Every test here fails on a3da9c2.
"""
import contextlib
import errno
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import LocalSGDTrainer, Simulation
from pflkit.core.storage.checkpoint import CHECKPOINT_NAME
from pflkit.core.cli.main import cli
from pflkit.core.common.errors import CheckpointError, PflError
from pflkit.core.storage.rundata import load_run
from pflkit.core.storage.rundir import RunDirLock
from pflkit.core.testing import tiny_config

TINY = ["--no-progress", "--set", "rounds=4", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
        "--set", "model.hidden=[16]"]
BROKEN = {"on": True}  # the failing trainers fail while this is on (a fixed plugin resumes the run)


def fl(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


class Expired(BaseException):
    pass


@contextlib.contextmanager
def within(seconds):
    """Fail (instead of hanging) when the block runs longer than ``seconds``: an input the core accepts and never
    finishes (SIGALRM, main thread)."""
    def expire(signum, frame):  # a BaseException: the client-call wrapper would count an Exception as a failure
        raise Expired(f"still running after {seconds} s: the input was accepted")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_clear_line(res, fragment, status=2):
    assert res.exit_code == status, res.output
    assert "Traceback" not in res.output
    assert fragment in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("Error:")]) <= 1, res.output


class RaisesInRound2(LocalSGDTrainer):
    def local_update(self):
        if BROKEN["on"] and self.ctx.round == 2:
            raise RuntimeError("training broken in round 2")
        return super().local_update()


class DivergesInRound2(LocalSGDTrainer):
    def local_update(self):
        loss = super().local_update()
        if BROKEN["on"] and self.ctx.round == 2:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("inf"))
            return float("nan")
        return loss


class StoppedInRound2(LocalSGDTrainer):
    def local_update(self):
        if BROKEN["on"] and self.ctx.round == 2:
            raise KeyboardInterrupt  # Ctrl-C pressed twice: stop at once
        return super().local_update()


@pytest.fixture
def failing(registries_snapshot):
    BROKEN["on"] = True
    registries_snapshot.TRAINERS.register("raises_r2", RaisesInRound2)
    registries_snapshot.TRAINERS.register("diverges_r2", DivergesInRound2)
    registries_snapshot.TRAINERS.register("stopped_r2", StoppedInRound2)
    yield registries_snapshot
    BROKEN["on"] = True


def _start(tmp_path, trainer, *extra):
    return fl("run", "--plugin", "fedavg", "--set", f"trainer.name={trainer}", "--set", f"output_dir={tmp_path}",
              "--set", "run_name=r", *TINY, *extra)


def _lock_is_free(run):
    lock = RunDirLock(run)
    lock.acquire()  # raises when the failed process still held it
    lock.release()


# -- H3: a failure during the rounds keeps the record --------------------------------------------------------------
@pytest.mark.parametrize("trainer", ["raises_r2", "diverges_r2"])
def test_a_failure_in_round_two_before_any_checkpoint_keeps_the_record(tmp_path, failing, trainer):
    res = _start(tmp_path, trainer, "--set", "checkpoint.every=10")
    one_clear_line(res, "every selected client failed in round 2")
    run = tmp_path / "r"
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "partition.json", "metrics.jsonl", "run.log", "summary.json", "tb"} <= names
    assert CHECKPOINT_NAME not in names and any((run / "tb").iterdir())
    rounds = [json.loads(ln)["round"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["interrupted"] is True
    assert summary["rounds_completed"] == 1 and summary["stopped_in_round"] == 2 and summary["rounds"] == 4
    selected = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["clients_selected"]
    assert summary["client_failures"] == selected  # the failing round's rejections count, though it logged no record
    assert summary["reason"].startswith("every selected client failed in round 2") and "\n" not in summary["reason"]
    assert "FAILED in round 2 of 4: every selected client failed in round 2" in (run / "run.log").read_text()
    _lock_is_free(run)
    assert load_run(run).status == "failed"  # fl plot / export: never 'finished'
    # nothing to resume from: one line, exit 2, and the record stays as it was
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    res = fl("run", "--resume", str(run), "--no-progress")
    one_clear_line(res, "has no checkpoint to resume from: its run failed before its first checkpoint (in round 2")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_a_failure_after_a_checkpoint_resumes_from_it(tmp_path, failing):
    res = _start(tmp_path, "raises_r2", "--set", "checkpoint.every=1")
    one_clear_line(res, "every selected client failed in round 2")
    run = tmp_path / "r"
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    _lock_is_free(run)
    BROKEN["on"] = False  # the plugin is fixed
    res = fl("run", "--resume", str(run), "--no-progress")
    assert res.exit_code == 0, res.output
    assert f"resuming {run} after round 1" in res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds_completed"] == 4 and not summary["interrupted"]
    assert [json.loads(ln)["round"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_run_failing_in_its_final_checkpoint_is_never_reused_as_finished(tmp_path, failing, monkeypatch):
    import pflkit.core.engine.simulation as simulation
    from pflkit.core.results.compare import _existing_run

    real = simulation.save_checkpoint

    def full_disk(run_dir, state, meta):
        if meta["round"] == 2:
            raise CheckpointError(f"cannot write {run_dir / CHECKPOINT_NAME}: No space left on device")
        return real(run_dir, state, meta)

    monkeypatch.setattr(simulation, "save_checkpoint", full_disk)
    cfg = tiny_config("fedavg", {"checkpoint": {"every": 1}})
    with pytest.raises(CheckpointError, match="No space left"):
        Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False).run()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["rounds_completed"] == cfg.rounds == 2 and summary["status"] == "failed"
    assert _existing_run(tmp_path / "r", cfg)[0] == "resume"  # the checkpoint of round 1, not a finished run


def test_ctrl_c_during_the_rounds_keeps_the_record_and_restarts(tmp_path, failing):
    res = _start(tmp_path, "stopped_r2", "--set", "checkpoint.every=10")
    assert res.exit_code == 130 and "Traceback" not in res.output
    run = tmp_path / "r"
    assert f"the record of its rounds stays in {run}" in res.output and f"fl run --resume {run}" in res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 1
    assert (run / "metrics.jsonl").read_text().strip()
    _lock_is_free(run)
    BROKEN["on"] = False
    res = fl("run", "--resume", str(run), "--no-progress")  # no checkpoint: starts again from round 0
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"



def test_a_failure_before_round_one_leaves_nothing(tmp_path, registries_snapshot):
    from pflkit.core.api.server import GlobalModelAggregator

    class BrokenSetup(GlobalModelAggregator):
        def setup(self, channel):
            raise PflError("set-up broken")

    registries_snapshot.AGGREGATORS.register("broken_setup", BrokenSetup)
    out = tmp_path / "runs"
    res = fl("run", "--plugin", "fedavg", "--set", "aggregator.name=broken_setup", "--set", f"output_dir={out}",
             *TINY)
    one_clear_line(res, "set-up broken")
    assert not out.exists()  # neither the run directory nor the output folder this start created


@pytest.mark.parametrize("plugin, setting, fragment", [
    ("lgfedavg", "trainer.global_layers=100", "trainer.global_layers: 100"),
    ("fedala", "trainer.ala_layers=1000", "trainer.ala_layers: 1000"),
    ("fedfomo", "trainer.val_ratio=0", "trainer.val_ratio: 0"),
    ("ifca", "aggregator.clusters=1000", "aggregator.clusters: 1000"),
])
def test_plugin_option_refusals_leave_no_runs_folder(tmp_path, monkeypatch, plugin, setting, fragment):
    monkeypatch.chdir(tmp_path)  # the default output_dir: ./runs
    res = fl("run", "--plugin", plugin, "--set", setting, "--set", "rounds=1", "--set", "partition.num_clients=4",
             "--no-progress")
    one_clear_line(res, fragment)
    assert not (tmp_path / "runs").exists() and not any(tmp_path.iterdir())


# -- spill files: gone after a clean finish, and the run still resumes -------------------------------------------
def test_spill_files_go_after_a_clean_finish_and_the_run_resumes(tmp_path):
    spill = ["--set", "clients.state_memory=0", "--set", "checkpoint.every=0"]
    base = ["run", "--plugin", "ditto", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "model.name=mlp",
            "--set", "model.hidden=[16]", "--set", "partition.num_clients=4", *spill]
    assert fl(*base, "--set", "run_name=part", "--set", "rounds=2").exit_code == 0
    part = tmp_path / "part"
    assert (part / CHECKPOINT_NAME).is_file() and not (part / "client_state").exists()
    res = fl("run", "--resume", str(part), "--set", "rounds=3", "--no-progress")
    assert res.exit_code == 0, res.output
    assert not (part / "client_state").exists()
    assert fl(*base, "--set", "run_name=full", "--set", "rounds=3").exit_code == 0

    def rows(run):
        return [{k: v for k, v in json.loads(ln).items() if "seconds" not in k}
                for ln in (run / "metrics.jsonl").read_text().splitlines()]

    assert rows(part) == rows(tmp_path / "full")  # resumed from the checkpoint: the uninterrupted numbers


def test_spill_files_go_in_a_two_process_run_too(tmp_path):
    """``--workers 2``: each process spills its own clients' states; a clean finish removes every folder, and a
    failure in round 2 keeps the record (rank 0 writes it)."""
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.start_processes(_two_rank_worker, args=(2, port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned processes did not finish in time"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    done = tmp_path / "done"
    assert (done / CHECKPOINT_NAME).is_file() and not (done / "client_state").exists()
    failed = tmp_path / "failed"
    summary = json.loads((failed / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 1
    assert "every selected client failed in round 2" in summary["reason"]
    _lock_is_free(failed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("PFLKIT_RENDEZVOUS_TIMEOUT", "60")
    import torch.distributed as dist

    from pflkit.core.api import registry as reg
    from pflkit.core.distributed.backend import DistributedBackend
    from pflkit.core.distributed.worker import Endpoint, RunRequest, _run, init_group

    reg.TRAINERS.register("raises_r2", RaisesInRound2, replace=True)
    ep = Endpoint(rank, world, rank, "127.0.0.1", port)
    init_group(ep)
    common = ("model.name=mlp", "model.hidden=[16]", "partition.num_clients=4", f"output_dir={out}")
    try:
        req = RunRequest("ditto", None, common + ("rounds=2", "run_name=done", "clients.state_memory=0"),
                         progress=False)
        assert _run(req, ep, DistributedBackend()) == 0
        req = RunRequest("fedavg", None, common + ("rounds=3", "run_name=failed", "trainer.name=raises_r2",
                                                   "checkpoint.every=10"), progress=False)
        with pytest.raises(PflError, match="every selected client failed in round 2"):
            _run(req, ep, DistributedBackend())
        dist.barrier()  # both ranks past the failed run before the group goes (a rank tearing it down early aborts)
    finally:
        dist.destroy_process_group()


# -- Medium inputs: one line, exit 2 ----------------------------------------------------------------------------
@pytest.mark.parametrize("sets, fragment", [
    (["split.fraction=0.01"], "split.fraction: 0.01 leaves client 0 with 2 training and 0 test samples"),
    (["eval.adapt=every", f"eval.adapt_steps={10 ** 12}"], "eval.adapt_steps: 1000000000000 is invalid: must be "
                                                          "at most 100,000"),
    (["eval.adapt=every", f"eval.adapt_epochs={10 ** 9}"], "eval.adapt_epochs: 1000000000 is invalid: must be at "
                                                          "most 1,000"),
    (["model.name=mlp", "model.hidden=[1000000,1000000]"], "parameters for inputs of shape (1, 8, 8); at most "
                                                           "1,073,741,824 are allowed"),
])
def test_medium_inputs_are_one_line(tmp_path, sets, fragment):
    args = [a for s in sets for a in ("--set", s)]
    with within(60):
        res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path / 'runs'}",
                 "--set", "rounds=1", *args)
    one_clear_line(res, fragment)
    assert not (tmp_path / "runs").exists()


def test_a_million_entry_hidden_list_is_one_line(tmp_path):
    config = tmp_path / "big.json"
    config.write_text(json.dumps({"model": {"name": "mlp", "hidden": [4] * 1_000_000}, "rounds": 1,
                                  "output_dir": str(tmp_path / "runs")}))
    with within(30):
        res = fl("run", "--plugin", "fedavg", "--config", str(config), "--no-progress")
    one_clear_line(res, "model.hidden: 1,000,000 entries is invalid: a model's list option may have at most 1,000")
    assert not (tmp_path / "runs").exists()


def test_the_bounds_are_stated_in_fl_show_core():
    text = fl("show", "core").output
    assert "1 to 100,000" in text and "1 to 1,000" in text
    assert "at most 1,073,741,824 parameters" in text and "at most 1,000 entries" in text


def test_new_plugin_with_a_300_character_name_is_one_line(tmp_path):
    res = fl("new-plugin", "a" * 300, "--dir", str(tmp_path / "pkgs"))
    one_clear_line(res, "300 characters is too long; use at most 64")
    assert not (tmp_path / "pkgs").exists()


def test_new_plugin_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    real = Path.write_text
    written = []

    def full(self, *args, **kwargs):
        if written:  # the first file fits, the second does not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    res = fl("new-plugin", "fresh", "--dir", str(tmp_path / "pkgs"))
    one_clear_line(res, "No space left on device; nothing was written")
    assert written and not (tmp_path / "pkgs").exists()
