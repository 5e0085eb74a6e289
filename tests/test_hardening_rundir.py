"""Run directories are shared: nothing planted in one makes pflkit write elsewhere, and resume trusts only what the
checkpoint covers (issue 21, items 1 and 2).

- a link (or FIFO) where pflkit expects its own file or folder is refused with one line naming it, exit 2, and the
  link's target is left untouched -- on ``fl run --resume`` and on a new start reusing a directory;
- an edited partition.json, a crafted checkpoint header and swapped or copied spill files are one line each;
- a disk that fills while spilling and a pooled trainer whose state swap raises end in one line (or a failed
  client), never a traceback.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import LocalSGDTrainer
from pflkit.core.storage.checkpoint import load_checkpoint, save_checkpoint
from pflkit.core.cli.main import cli
from pflkit.core.api.clientstate import ClientStateStore
from pflkit.core.common.errors import CheckpointError
from pflkit.core.common.safefiles import RunFileError, read_regular, write_atomic

TINY = ["--no-progress", "--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
        "--set", "model.hidden=[32]", "--set", "checkpoint.every=0"]


def fl(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def one_clear_line(res, fragment, status=2):
    assert res.exit_code == status, res.output
    assert "Traceback" not in res.output
    assert fragment in res.output, res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("Error:")]) == 1, res.output


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A finished 2-round run whose client states spilled to client_state/ (Ditto keeps a personal model; a zero
    memory budget spills every state), copied for each test. A clean finish removes the spill files (issue 29: the
    checkpoint holds the states); the folder a killed process would leave is put back, for the tests below."""
    root = tmp_path_factory.mktemp("template")
    res = fl("run", "--plugin", "ditto", "--set", f"output_dir={root}", "--set", "run_name=r",
             "--set", "clients.state_memory=0", *TINY)
    assert res.exit_code == 0, res.output
    assert not (root / "r" / "client_state").exists()
    (root / "r" / "client_state").mkdir()
    (root / "r" / "client_state" / "0.pt").write_bytes(b"stale spill file of a killed process")
    return root / "r"


@pytest.fixture
def run(template, tmp_path):
    dst = tmp_path / "r"
    shutil.copytree(template, dst)
    (dst / "resumes.jsonl").touch()
    return dst


def snapshot(path: Path):
    if path.is_dir():
        return sorted((p.name, p.read_bytes()) for p in path.rglob("*"))
    return path.read_bytes()


# -- item 1: links in the run directory ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "summary.json", "run.log", "resumes.jsonl",
                                  "config.json", "run_info.json", "partition.json", "checkpoint.pt", "tb",
                                  "client_state"])
def test_resume_never_writes_through_a_planted_link(run, tmp_path, name):
    # the link points at a copy of the real file (so a resume that follows it would succeed and write there)
    victim = tmp_path / f"victim-{name.strip('.')}"
    if (run / name).is_dir():
        shutil.copytree(run / name, victim)
        shutil.rmtree(run / name)
    else:
        shutil.copy(run / name, victim)
        (run / name).unlink()
    before = snapshot(victim)
    os.symlink(victim, run / name)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), f"{run / name} is a symbolic link")
    assert snapshot(victim) == before
    assert (run / name).is_symlink()  # refused, not "repaired": the owner decides


def test_a_fifo_in_the_run_directory_is_refused_without_hanging(run):
    (run / "run.log").unlink()
    os.mkfifo(run / "run.log")
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), f"{run / 'run.log'} is a FIFO")


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "run.log"])
def test_a_new_start_reusing_a_directory_never_writes_through_a_link(tmp_path, name):
    # a start killed early leaves only start-up files: a new start reuses such a directory, but not with a link
    out, victim = tmp_path / "out", tmp_path / "victim"
    (out / "r").mkdir(parents=True)
    victim.write_text("precious\n")
    os.symlink(victim, out / "r" / name)
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={out}", "--set", "run_name=r", *TINY)
    one_clear_line(res, f"{out / 'r' / name} is a symbolic link")
    assert victim.read_text() == "precious\n"


def test_safefiles_primitives(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(RunFileError, match="symbolic link"):
        write_atomic(tmp_path / "link", "x")
    with pytest.raises(RunFileError, match="is a device"):
        read_regular("/dev/zero", 10)
    write_atomic(tmp_path / "f.json", "0123456789")
    with pytest.raises(RunFileError, match="more than the 5 bytes"):
        read_regular(tmp_path / "f.json", 5)
    assert read_regular(tmp_path / "f.json", 10) == b"0123456789" and target.read_text() == "keep"


# -- item 2: the checkpoint covers the partition; crafted headers ----------------------------------------------
def _edit_partition(run, edit):
    doc = json.loads((run / "partition.json").read_text())
    edit(doc["clients"])
    (run / "partition.json").write_text(json.dumps(doc))


def _test_index_into_training(clients):
    clients[0]["train_indices"].append(clients[0]["test_indices"].pop())


def _swap_two_clients(clients):
    clients[0], clients[1] = clients[1], clients[0]


@pytest.mark.parametrize("edit", [_test_index_into_training, _swap_two_clients])
def test_an_edited_partition_is_refused_on_resume(run, edit):
    _edit_partition(run, edit)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"),
                   f"{run / 'partition.json'} does not match {run / 'checkpoint.pt'}")


def test_a_partition_whose_clients_share_a_sample_is_refused(run, tmp_path):
    def share(clients):
        clients[1]["train_indices"].append(clients[0]["train_indices"][0])
    _edit_partition(run, share)
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), "clients 0 and 1 both hold sample")
    # the same split given to a new run through partition.from
    split = tmp_path / "split.json"
    doc = json.loads((run / "partition.json").read_text())
    split.write_text(json.dumps({"clients": [{"train": c["train_indices"], "test": c["test_indices"]}
                                             for c in doc["clients"]]}))
    res = fl("run", "--plugin", "fedavg", "--set", f"output_dir={tmp_path / 'out'}", "--set",
             f"partition.from={split}", *TINY)
    one_clear_line(res, f"partition file '{split}': clients 0 and 1 both hold sample")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("header, state, fragment", [
    ({"round": -5}, {"round": -5}, "header field 'round' is -5"),
    ({"round": "2"}, {}, "header field 'round' is '2'"),
    ({"round": float("nan")}, {}, "header field 'round' is nan"),
    ({"round": 10 ** 30}, {"round": 10 ** 30}, "header field 'round'"),
    ({"num_clients": -1}, {}, "header field 'num_clients' is -1"),
    ({"torch_threads": 0}, {}, "header field 'torch_threads' is 0"),
    ({}, {"round": 1}, "round 1 (header: 2)"),
    ({}, {"setup_calls": -3}, "setup_calls -3"),
    ({}, {"totals": {"bytes_up": -1, "bytes_down": 0, "failures": 0}}, "totals are not non-negative integers"),
])
def test_crafted_checkpoint_values_are_refused(run, header, state, fragment):
    old_header, old_state = load_checkpoint(run)
    meta = {k: v for k, v in old_header.items() if k not in ("format_version", "body_sha256", "body_bytes",
                                                             "index_bytes")}
    save_checkpoint(run, {**old_state, **state}, {**meta, **header})
    one_clear_line(fl("run", "--resume", str(run), "--set", "rounds=3"), fragment)


# -- spill files -------------------------------------------------------------------------------------------------
def _spilled_store(tmp_path):
    store = ClientStateStore(budget=0, spill_dir=tmp_path / "client_state")
    for cid in (0, 1):
        store.put(cid, {"w": torch.full((4,), float(cid))})
    assert store.spilled == 2
    return store, tmp_path / "client_state"


def _swap(d):
    os.replace(d / "0.pt", d / "tmp")
    os.replace(d / "1.pt", d / "0.pt")
    os.replace(d / "tmp", d / "1.pt")


@pytest.mark.parametrize("tamper, fragment", [
    (_swap, "is not the file pflkit wrote for client 0"),
    (lambda d: shutil.copy(d / "1.pt", d / "0.pt"), "is not the file pflkit wrote for client 0"),
    (lambda d: torch.save([1, 2], d / "0.pt"), "is not the file pflkit wrote for client 0"),
    (lambda d: ((d / "0.pt").unlink(), os.symlink(d / "1.pt", d / "0.pt")), "symbolic link"),
])
def test_tampered_spill_files_are_refused(tmp_path, tamper, fragment):
    store, d = _spilled_store(tmp_path)
    assert torch.equal(store.get(1)["w"], torch.ones(4))
    tamper(d)
    with pytest.raises(CheckpointError, match=fragment):
        store.get(0)


def test_spill_files_swapped_during_a_run_stop_it_with_one_error(tmp_path):
    from pflkit.core.engine.simulation import Simulation
    from pflkit.core.testing import tiny_config

    cfg = tiny_config("ditto", {"rounds": 3, "clients": {"state_memory": 0}})
    sim = Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False)
    # after round 1 every client's state is on disk; swapping two files would silently swap their personal models
    with pytest.raises(CheckpointError, match=r"client_state/0\.pt is not the file pflkit wrote for client 0"):
        sim.run(on_round=lambda record: record["round"] == 1 and _swap(tmp_path / "r" / "client_state"))


def test_a_spill_folder_swapped_for_a_link_mid_run_redirects_nothing(tmp_path):
    store, d = _spilled_store(tmp_path)  # the store holds client_state/ open from its first spill
    victim = tmp_path / "victim"
    victim.mkdir()
    os.replace(d, tmp_path / "moved")
    os.symlink(victim, d)
    store.put(2, {"w": torch.full((4,), 2.0)})
    assert not any(victim.iterdir()) and (tmp_path / "moved" / "2.pt").is_file()
    assert torch.equal(store.get(2)["w"], torch.full((4,), 2.0))


def test_a_spill_file_holding_another_client_is_refused(tmp_path):
    store, d = _spilled_store(tmp_path)
    store._sums["0.pt"] = store._sums["1.pt"]  # even with a matching checksum, the client id inside must match
    shutil.copy(d / "1.pt", d / "0.pt")
    with pytest.raises(CheckpointError, match="does not hold client 0's state"):
        store.get(0)


def test_a_disk_filling_while_spilling_is_one_line(tmp_path, monkeypatch):
    def full(*args, **kwargs):  # what torch's zip writer raises when the disk is full
        raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr("pflkit.core.api.clientstate.torch.save", full)  # the first spill is in round 1
    res = fl("run", "--plugin", "ditto", "--set", f"output_dir={tmp_path}", "--set", "clients.state_memory=0", *TINY)
    one_clear_line(res, "PytorchStreamWriter failed writing file data/0: file write failed; the run's last "
                        "checkpoint is intact")
    # the spill is in round 1: the rounds had started, so the run keeps its record and says why (issue 29)
    [run] = list(tmp_path.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "file write failed" in summary["reason"]


# -- a pooled trainer whose state swap raises ------------------------------------------------------------------
class SwapInFails(LocalSGDTrainer):
    declares_state = True  # pooled: one working trainer, states swapped in and out

    def load_client_state(self, state):
        if self.ctx.cid == 1:
            raise ValueError("cannot load")
        super().load_client_state(state)


class SwapOutFails(LocalSGDTrainer):
    declares_state = True

    def client_state(self):
        if self.ctx.cid == 2:
            raise ValueError("cannot save")
        return super().client_state()


@pytest.mark.parametrize("trainer", [SwapInFails, SwapOutFails])
def test_a_pooled_state_swap_that_raises_is_a_failed_client(tmp_path, registries_snapshot, trainer):
    # like any client error: skipped (and counted) by default; failures.on_client_error=abort stops the run
    registries_snapshot.TRAINERS.register("swap_fails", trainer)
    args = ["run", "--plugin", "fedavg", "--set", "trainer.name=swap_fails", "--set", f"output_dir={tmp_path}", *TINY]
    res = fl(*args, "--set", "run_name=r")
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["client_failures"] >= 2
    res = fl(*args, "--set", "run_name=abort", "--set", "failures.on_client_error=abort")
    assert res.exit_code == 2 and "swapping its state" in res.output, res.output


@pytest.mark.parametrize("splits, fragment", [
    ([([0, 1], [2]), ([3, 0], [4])], "clients 0 and 1 both hold sample 0"),
    ([([0, 1], [1]), ([3, 5], [4])], "client 0's sample 1 is in both its train and its test set"),
    ([([0, 1, 1], [2]), ([3, 5], [4])], "client 0 holds sample 1 twice in its train set"),
])
def test_shared_samples_name_the_clients(splits, fragment):
    import numpy as np

    from pflkit.core.data.data import ClientSplit, check_no_shared_samples
    from pflkit.core.common.errors import DataError

    with pytest.raises(DataError, match=fragment):
        check_no_shared_samples([ClientSplit(np.array(a), np.array(b)) for a, b in splits], "partition")
    check_no_shared_samples([ClientSplit(np.array([0, 1]), np.array([2])), ClientSplit(np.array([3]), np.array([]))],
                            "partition")


def test_temporaries_of_a_killed_rewrite_are_removed_on_resume(run):
    for name in (".config.json-k1ll3d.tmp", ".summary.json-x.tmp"):
        (run / name).write_text("{half")
    res = fl("run", "--resume", str(run), "--set", "rounds=3")
    assert res.exit_code == 0, res.output
    assert not list(run.glob(".*.tmp"))
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 3
