"""Adversarial inputs: untrusted files are data, run directories belong to one run, no input ends in a traceback.

Every input here goes through the ``fl`` command and must end in one clear line with exit status 2 (130 for an
interrupt), lose nothing, and leave no half-made run directory. The README quotes the number of cases.
"""
import errno
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import LocalSGDTrainer
from pflkit.core.storage.checkpoint import CHECKPOINT_NAME, MAGIC, load_checkpoint, read_header, save_checkpoint
from pflkit.core.cli.main import cli
from pflkit.core.storage.rundir import RunDirLock

TINY = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
        "--set", "model.hidden=[16]", "--set", "checkpoint.every=0"]


def fl(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def one_clear_line(res, fragment, status=2):
    assert res.exit_code == status, res.output
    assert "Traceback" not in res.output
    assert fragment in res.output, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) <= 1


def finished_run(tmp_path, name="r", *extra):
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}",
             "--set", f"run_name={name}", *TINY, *extra)
    assert res.exit_code == 0, res.output
    return tmp_path / name


# -- bad values on the command line ------------------------------------------------------------------------------
NON_UTF8 = b"rounds = 3\n# caf\xe9\n"


@pytest.mark.parametrize("sets, fragment", [
    (["seed=-1"], "seed: -1 is invalid: must lie in [0, 2**63)"),
    ([f"seed={2 ** 70}"], "seed: 1180591620717411303424 is invalid"),
    (["partition.seed=-5"], "partition.seed: -5 is invalid"),
    (['participation.random_join_ratio=["a","b"]'], "must be a pair of numbers"),
    (["participation.random_join_ratio=[0.5]"], "must be a pair of numbers"),
    (["train.lr=Infinity"], "train.lr: inf is invalid: must be a finite number"),
    (["train.momentum=Infinity"], "train.momentum: inf is invalid: must be a finite number"),
    (["train.lr=NaN"], "train.lr: nan is invalid"),
    (["run_name=../escaped"], "run_name: '../escaped' is invalid: must be a plain folder name"),
    (["run_name=/tmp/absolute"], "run_name: '/tmp/absolute' is invalid"),
    (["run_name=a/b"], "run_name: 'a/b' is invalid"),
    (["run_name=.."], "run_name: '..' is invalid"),
    (["split.test_ratio=1.0"], "client 0 has 1 training samples, it needs at least 2"),
])
def test_bad_values_are_one_line_and_leave_nothing(tmp_path, sets, fragment):
    out = tmp_path / "out"
    args = ["run", "--plugin", "fedavg", "--set", f"output_dir={out}", *TINY]
    for s in sets:
        args += ["--set", s]
    one_clear_line(fl(*args), fragment)
    assert not out.exists() or not any(out.iterdir())
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/absolute").exists()


@pytest.mark.parametrize("command", ["run", "partition"])
def test_config_file_that_is_not_utf8(tmp_path, command):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(NON_UTF8)
    args = [command, "--config", str(cfg)] + (["--plugin", "fedavg"] if command == "run" else
                                              ["--out", str(tmp_path / "p.png")])
    one_clear_line(fl(*args), "is not UTF-8 text")


def test_binary_file_as_csv_dataset(tmp_path):
    data = tmp_path / "data.csv"
    data.write_bytes(bytes(range(256)) * 20)
    one_clear_line(fl("run", "--plugin", "fedavg", "--set", f"output_dir={tmp_path / 'o'}",
                      "--set", "dataset.name=csv", "--set", f"dataset.path={data}",
                      "--set", "dataset.label_column=y", *TINY), "is not a UTF-8 CSV text file")
    assert not (tmp_path / "o").exists()


# -- untrusted files on resume -------------------------------------------------------------------------------
def test_malicious_pickle_checkpoint_runs_no_code(tmp_path):
    run = finished_run(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    # a well-formed header with the right checksum around a pickle that would run code when unpickled
    header, _ = read_header(run / CHECKPOINT_NAME)
    import hashlib
    import io
    import zipfile
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)  # a real torch zip, whose data.pkl we replace
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for item in src.infolist():
            data = pickle.dumps(Exploit(), protocol=2) if item.filename.endswith("data.pkl") else src.read(item)
            z.writestr(item, data)
    body = out.getvalue()
    header.update(body_sha256=hashlib.sha256(body).hexdigest(), body_bytes=len(body))
    (run / CHECKPOINT_NAME).write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + body)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "not plain tensors and containers")
    assert not marker.exists()
    # and a raw pickle file (no header) is not even opened as one
    (run / CHECKPOINT_NAME).write_bytes(pickle.dumps(Exploit()))
    one_clear_line(fl("run", "--resume", str(run)), "is not a pflkit checkpoint")
    assert not marker.exists()


def test_flipped_bytes_inside_a_tensor_are_detected(tmp_path):
    run = finished_run(tmp_path)
    raw = bytearray((run / CHECKPOINT_NAME).read_bytes())
    for i in range(len(raw) - 200, len(raw) - 184):  # 16 bytes in the body's tensor data
        raw[i] ^= 0xFF
    (run / CHECKPOINT_NAME).write_bytes(bytes(raw))
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "checksum mismatch")


def test_checkpoint_of_the_old_format_is_refused(tmp_path):
    run = finished_run(tmp_path)
    torch.save({"format_version": 1, "round": 2}, run / CHECKPOINT_NAME)
    one_clear_line(fl("run", "--resume", str(run)), "older pflkit (format 1)")


@pytest.mark.parametrize("edit, value", [("seed", 5), ("algorithm", "fedprox"), ("train", {"lr": 0.5})])
def test_hand_edited_config_is_refused(tmp_path, edit, value):
    run = finished_run(tmp_path)
    cfg = json.loads((run / "config.json").read_text())
    cfg[edit] = value if not isinstance(value, dict) else {**cfg[edit], **value}
    if edit == "algorithm":
        cfg["trainer"]["name"] = "fedprox"
    (run / "config.json").write_text(json.dumps(cfg))
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "does not match")


def test_checkpoint_of_another_algorithm_with_the_same_clients_is_refused(tmp_path):
    run = finished_run(tmp_path, "a")
    other = tmp_path / "b"
    res = fl("run", "--plugin", "fedprox", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=b",
             *TINY)
    assert res.exit_code == 0
    (run / CHECKPOINT_NAME).write_bytes((other / CHECKPOINT_NAME).read_bytes())
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "checkpoint of algorithm 'fedprox'")


def test_checkpoint_with_missing_keys_is_refused(tmp_path):
    run = finished_run(tmp_path)
    header, state = load_checkpoint(run)
    del state["history"], state["clients"][0]
    meta = {k: v for k, v in header.items() if k not in ("format_version", "body_sha256", "body_bytes")}
    save_checkpoint(run, state, meta)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "does not fit this run")


@pytest.mark.parametrize("damage, fragment", [
    ("not json at all", "partition file"),
    ('{"clients": [{"train_indices": [1, 2], "test_indices": ["x"]}]}', "partition file"),
])
def test_corrupt_partition_file_on_resume(tmp_path, damage, fragment):
    run = finished_run(tmp_path)
    (run / "partition.json").write_text(damage)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), fragment)


def test_out_of_range_index_in_partition_file(tmp_path):
    run = finished_run(tmp_path)
    doc = json.loads((run / "partition.json").read_text())
    doc["clients"][1]["train_indices"][0] = 10 ** 6
    (run / "partition.json").write_text(json.dumps(doc))
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "client 1's train index 1000000 is out of range")


def test_half_written_metrics_line_is_dropped_on_resume(tmp_path):
    run = finished_run(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"round": 3, "train_lo')
    res = fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress")
    assert res.exit_code == 0, res.output
    rounds = [json.loads(ln)["round"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]


def test_full_disk_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = finished_run(tmp_path)
    before = (run / CHECKPOINT_NAME).read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress"),
                   "No space left on device; the previous checkpoint is intact")
    monkeypatch.undo()
    assert (run / CHECKPOINT_NAME).read_bytes() == before
    assert not list(run.glob(".checkpoint-*.tmp"))
    res = fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress")
    assert res.exit_code == 0, res.output


def test_orphaned_temporary_checkpoints_are_removed_on_the_next_start(tmp_path):
    run = finished_run(tmp_path)
    (run / ".checkpoint-abc123.tmp").write_bytes(b"half a checkpoint")
    assert fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress").exit_code == 0
    assert not list(run.glob(".checkpoint-*.tmp"))


# -- resuming: what may change ---------------------------------------------------------------------------------
def test_resume_may_extend_a_finished_run_and_records_it(tmp_path):
    run = finished_run(tmp_path)
    res = fl("run", "--resume", str(run), "--set", "rounds=4", "--set", "eval.every=2", "--no-progress")
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 4
    assert json.loads((run / "config.json").read_text())["rounds"] == 4
    entry = json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])
    assert entry["from_round"] == 2 and entry["overrides"] == {"rounds": 4, "eval": {"every": 2}}
    # the extended run equals a run of 4 rounds with evaluation every 2 from the start
    res = fl("run", "--plugin", "fedavg", "--no-progress", "--set", f"output_dir={tmp_path}", "--set", "run_name=s",
             *TINY, "--set", "rounds=4")
    assert res.exit_code == 0
    last = lambda d: json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])["train_loss"]
    assert last("r") == last("s")


@pytest.mark.parametrize("sets, fragment", [
    (["seed=3"], "--set seed: cannot change on resume"),
    (["train.lr=0.1"], "--set train.lr: cannot change on resume"),
    (["rounds=1"], "rounds: 1 is invalid: the run has already completed 2 rounds"),
])
def test_resume_refuses_unsafe_changes(tmp_path, sets, fragment):
    run = finished_run(tmp_path)
    args = ["run", "--resume", str(run)]
    for s in sets:
        args += ["--set", s]
    one_clear_line(fl(*args), fragment)


def test_a_run_killed_before_its_first_checkpoint_resumes_from_round_zero(tmp_path):
    run = finished_run(tmp_path)
    full = json.loads((run / "summary.json").read_text())
    (run / CHECKPOINT_NAME).unlink()  # as if killed (SIGKILL) during round 1
    (run / "summary.json").unlink()
    res = fl("run", "--resume", str(run), "--no-progress")
    assert res.exit_code == 0, res.output
    again = json.loads((run / "summary.json").read_text())
    assert again["final"] == full["final"] and len((run / "metrics.jsonl").read_text().splitlines()) == 2


# -- one run per directory -------------------------------------------------------------------------------------
def test_a_second_process_cannot_use_a_run_directory_in_use(tmp_path):
    run = finished_run(tmp_path)
    lock = RunDirLock(run).acquire()  # another process holding the run (a different open file description)
    try:
        one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "is in use by another fl process")
    finally:
        lock.release()
    assert (run / ".lock").exists()  # the stale lock file of a finished process blocks nothing
    assert fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress").exit_code == 0


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    import subprocess
    run = finished_run(tmp_path)
    code = ("import sys, os; from pflkit.core.storage.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
            "os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", code, str(run)], timeout=60)
    assert fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress").exit_code == 0


# -- failures at start-up and during the run -------------------------------------------------------------------
def test_ctrl_c_during_start_up(tmp_path, monkeypatch):
    import pflkit.core.engine.simulation as simulation

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(simulation.Simulation, "_start", interrupted)
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={tmp_path}", "--set", "run_name=r", *TINY)
    assert res.exit_code == 130 and "Traceback" not in res.output and "interrupted during start-up" in res.output
    assert not (tmp_path / "r").exists()


class FailsEvaluation(LocalSGDTrainer):
    def on_evaluate(self, payload):
        raise RuntimeError("evaluation broken")


class FailsFit(LocalSGDTrainer):
    def local_update(self):
        raise RuntimeError("training broken")


def test_every_client_failing_evaluation_fails_the_run(tmp_path, registries_snapshot):
    registries_snapshot.TRAINERS.register("fails_eval", FailsEvaluation)
    res = fl("run", "--plugin", "fedavg", "--set", "trainer.name=fails_eval", "--set", f"output_dir={tmp_path}", *TINY)
    one_clear_line(res, "every client failed evaluation in round 1")


def test_a_run_that_fails_in_round_one_keeps_its_record(tmp_path, registries_snapshot):
    # issue 29 (H3): once its rounds have started, a failed run keeps its directory and says why
    registries_snapshot.TRAINERS.register("fails_fit", FailsFit)
    res = fl("run", "--plugin", "fedavg", "--set", "trainer.name=fails_fit", "--set", f"output_dir={tmp_path}", *TINY)
    one_clear_line(res, "every selected client failed in round 1")
    [run] = list(tmp_path.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0
    assert "every selected client failed in round 1" in (run / "run.log").read_text()


def test_summary_is_strict_json(tmp_path):
    from pflkit.core.engine.simulation import strict_json
    assert strict_json({"a": float("nan"), "b": [float("inf"), 1.0]}) == {"a": None, "b": [None, 1.0]}
    run = finished_run(tmp_path, "r", "--set", "eval.final_k=9")

    def refuse(name):
        raise ValueError(f"bare {name} in summary.json")

    json.loads((run / "summary.json").read_text(), parse_constant=refuse)


def test_plugin_calling_sys_exit_at_import_is_a_broken_plugin(registries_snapshot):
    from pflkit.core.common.errors import PluginError
    from pflkit.core.api.registry import Entry

    class ExitingEntryPoint:
        def load(self):
            sys.exit(3)

    entry = Entry("exits", "trainer", "bad:Trainer", "pflkit-bad", "0.1")
    entry._ep = ExitingEntryPoint()
    registries_snapshot.TRAINERS._entries["exits"] = entry
    with pytest.raises(PluginError, match="trainer 'exits' from distribution 'pflkit-bad' failed to load: SystemExit"):
        registries_snapshot.TRAINERS.get("exits")


def test_resuming_with_another_thread_count_warns(tmp_path, caplog):
    run = finished_run(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        res = fl("run", "--resume", str(run), "--set", "rounds=3", "--no-progress")
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0
    assert any("torch threads" in r.getMessage() and "numbers will differ" in r.getMessage()
               for r in caplog.records)
