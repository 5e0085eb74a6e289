"""Shared set-up results (core.api.artifacts, core/storage/artifacts.py): keyed by the strategy's key and the core's
(data, code, torch, device, threads), read back as data only, their making's cost replayed where they are loaded."""
import io
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pflkit.core import SharedArtifacts
from pflkit.core.cli.main import cli
from pflkit.core.results.compare import artifacts_of
from pflkit.core.storage.artifacts import ArtifactFolder, code_digest, run_key

CORE = {"data": {"dataset": {"name": "x"}}, "partition_sha256": "ab", "code": {}, "torch": "t", "device": "cpu",
        "threads": 1}


class Counter:
    def __init__(self):
        self.now = {"calls": 0, "bytes_up": 0, "bytes_down": 0}
        self.replayed = []

    def meter(self):
        return dict(self.now)

    def replay(self, cost):
        self.replayed.append(dict(cost))


def folder(tmp_path, core=CORE, counter=None):
    counter = counter or Counter()
    return ArtifactFolder(tmp_path / "shared", core, run_dir=tmp_path / "run", meter=counter.meter,
                          replay=counter.replay)


def test_without_a_folder_nothing_is_shared():
    none = SharedArtifacts()
    assert not none.enabled
    none.save("flow", {"a": 1}, {"w": torch.ones(2)})
    assert none.load("flow", {"a": 1}) is None and none.events == []


def test_a_result_comes_back_for_the_same_key_only(tmp_path):
    maker = folder(tmp_path)
    assert maker.load("flow", {"seed": 1}) is None
    maker.save("flow", {"seed": 1}, {"w": torch.arange(3.0), "n": torch.tensor(2)})
    got = folder(tmp_path).load("flow", {"seed": 1})
    assert torch.equal(got["w"], torch.arange(3.0)) and int(got["n"]) == 2
    assert folder(tmp_path).load("flow", {"seed": 2}) is None           # the strategy's key
    assert folder(tmp_path).load("other", {"seed": 1}) is None          # the name
    for change in ({"partition_sha256": "cd"}, {"threads": 2}, {"code": {"pflkit": "0"}}, {"torch": "u"}):
        assert folder(tmp_path, {**CORE, **change}).load("flow", {"seed": 1}) is None  # the core's part
    assert [e["action"] for e in maker.events] == ["saved"]


def test_the_making_cost_is_replayed_where_the_result_is_loaded(tmp_path):
    counter = Counter()
    maker = folder(tmp_path, counter=counter)
    counter.now = {"calls": 2, "bytes_up": 10, "bytes_down": 30}
    assert maker.load("flow", {}) is None                  # the miss marks where making it starts
    counter.now = {"calls": 9, "bytes_up": 110, "bytes_down": 330}
    maker.save("flow", {}, {"w": torch.zeros(1)})
    user_counter = Counter()
    user = folder(tmp_path, counter=user_counter)
    assert user.load("flow", {}) is not None
    assert user_counter.replayed == [{"calls": 7, "bytes_up": 100, "bytes_down": 300}]
    assert user.events[0]["made_by"] == str(tmp_path / "run")


class Boom:
    def __reduce__(self):
        return (os.system, ("touch " + str(Path(os.environ["BOOM_MARK"])),))


def test_a_file_is_data_never_code(tmp_path, monkeypatch, caplog):
    maker = folder(tmp_path)
    maker.save("flow", {}, {"w": torch.zeros(1)})
    (path,) = (tmp_path / "shared").glob("flow-*.pt")
    mark = tmp_path / "executed"
    monkeypatch.setenv("BOOM_MARK", str(mark))
    buffer = io.BytesIO()
    torch.save({"format": "pflkit-artifact/1", "tensors": {"w": torch.zeros(1)}, "evil": Boom()}, buffer,
               pickle_protocol=2)
    path.write_bytes(buffer.getvalue())
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        assert folder(tmp_path).load("flow", {}) is None
    assert not mark.exists() and "ignored" in caplog.text


def _only_file(tmp_path):
    (path,) = (tmp_path / "shared").glob("flow-*.pt")
    return path


def test_a_foreign_file_is_ignored_with_its_reason(tmp_path, caplog, monkeypatch):
    folder(tmp_path).save("flow", {}, {"w": torch.zeros(1)})
    path = _only_file(tmp_path)
    good = path.read_bytes()
    buffer = io.BytesIO()
    torch.save({"format": "other"}, buffer)
    cases = [(buffer.getvalue(), "not a pflkit-artifact/1 file")]
    # a file of another key (signed, renamed onto this key's name)
    other = folder(tmp_path / "o")
    other.save("flow", {"seed": 2}, {"w": torch.ones(1)})
    cases.append((_only_file(tmp_path / "o").read_bytes(), "made for another key"))
    # the same result signed by another user (another verify.key)
    monkeypatch.setenv("PFLKIT_STATE", str(tmp_path / "someone-else"))
    folder(tmp_path / "u").save("flow", {}, {"w": torch.zeros(1)})
    cases.append((_only_file(tmp_path / "u").read_bytes(), "not signed with this user's key"))
    monkeypatch.undo()
    # one byte of the signed body changed
    edited = bytearray(good)
    edited[len(edited) // 2] ^= 1
    cases.append((bytes(edited), "ignored"))
    for data, why in cases:
        caplog.clear()
        path.write_bytes(data)
        with caplog.at_level(logging.WARNING, logger="pflkit"):
            assert folder(tmp_path).load("flow", {}) is None
        assert why in caplog.text, why
    path.write_bytes(good)
    assert folder(tmp_path).load("flow", {}) is not None


def test_a_link_is_neither_read_nor_written_through(tmp_path, caplog):
    maker = folder(tmp_path)
    maker.save("flow", {}, {"w": torch.zeros(1)})
    (path,) = (tmp_path / "shared").glob("flow-*.pt")
    target = tmp_path / "elsewhere.pt"
    target.write_bytes(path.read_bytes())
    before = target.read_bytes()
    path.unlink()
    path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        assert folder(tmp_path).load("flow", {}) is None
        folder(tmp_path).save("flow", {}, {"w": torch.ones(1)})   # refused with a warning, never raised
    assert target.read_bytes() == before and path.is_symlink()  # nothing written through the link
    assert "not saved" in caplog.text


def test_bad_names_and_values_are_refused(tmp_path):
    shared = folder(tmp_path)
    with pytest.raises(ValueError, match="letters, digits"):
        shared.save("../flow", {}, {"w": torch.zeros(1)})
    with pytest.raises(TypeError, match="not a tensor"):
        shared.save("flow", {}, {"w": [1.0]})


def test_the_core_key_covers_data_code_and_threads(monkeypatch):
    from pflkit.core.testing import resolve

    cfg = resolve([{"dataset": {"name": "digits", "root": "/a"}}], algorithm="fedavg")
    other_root = resolve([{"dataset": {"name": "digits", "root": "/b"}}], algorithm="fedavg")
    key = run_key(cfg, "ab", ())
    assert key == run_key(other_root, "ab", ())                    # where data are read from is not what they are
    assert key != run_key(cfg, "cd", ())
    assert set(code_digest(())) == {"pflkit"} and len(code_digest(())["pflkit"]) == 64
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert run_key(cfg, "ab", ())["threads"] == 7


def test_a_comparison_shares_through_its_own_folder(tmp_path):
    assert artifacts_of(tmp_path / "out" / "runs" / "pcfl-seed0") == tmp_path / "out" / "artifacts"


def test_fl_run_refuses_artifacts_with_workers(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--plugin", "fedavg", "--workers", "2", "--artifacts", str(tmp_path)])
    assert result.exit_code == 2
    assert "--artifacts: a distributed run" in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())
