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
    # the device is the run's resolved type: 'auto' on a machine without a GPU is 'cpu', as a run with device = cpu
    auto = resolve([{"dataset": {"name": "digits"}, "device": "auto"}], algorithm="fedavg")
    assert run_key(auto, "ab", (), device="cpu")["device"] == run_key(cfg, "ab", (), device="cpu")["device"] == "cpu"
    assert run_key(cfg, "ab", (), device="cuda")["device"] == "cuda"


def test_the_code_digest_covers_what_an_import_reads_only(tmp_path, monkeypatch):
    """A namespace package (pflkit) spread over two folders -- a checkout and a stray install that no import reads
    -- digests its parts as imported: the stray copy changes nothing, an edit of the imported code does."""
    import importlib
    import sys

    from pflkit.core.storage.artifacts import package_digest

    def write(root, text):
        (root / "nsdemo" / "core").mkdir(parents=True, exist_ok=True)
        (root / "nsdemo" / "core" / "__init__.py").write_text(text)

    def digest(*roots):
        for name in [m for m in sys.modules if m == "nsdemo" or m.startswith("nsdemo.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(sys, "path", [str(r) for r in roots] + sys.path)
        importlib.invalidate_caches()
        package_digest.cache_clear()
        return package_digest("nsdemo")

    used, stray = tmp_path / "checkout", tmp_path / "site-packages"
    write(used, "x = 1\n")
    write(stray, "x = 2  # an older install, shadowed\n")
    alone = digest(used)
    assert len(alone) == 64 and digest(used, stray) == alone
    write(used, "x = 3\n")
    assert digest(used, stray) != alone
    (tmp_path / "single.py").write_text("y = 1\n")   # a plugin that is one module
    assert len(digest(tmp_path)) == 64 and package_digest("single") != ""
    package_digest.cache_clear()


def test_a_comparison_shares_through_its_own_folder(tmp_path):
    assert artifacts_of(tmp_path / "out" / "runs" / "pcfl-seed0") == tmp_path / "out" / "artifacts"


def test_fl_run_refuses_artifacts_with_workers(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--plugin", "fedavg", "--workers", "2", "--artifacts", str(tmp_path)])
    assert result.exit_code == 2
    assert "--artifacts: a distributed run" in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


# -- runs started at once make a result once (a lock on its make) -------------------------------------------------
def _hold_lock(tmp_path, name="flow", key=None):
    """Hold the make lock of ``name``/``key`` as another process would (a descriptor this process's folders don't
    know of)."""
    import fcntl

    path, _ = folder(tmp_path)._path_and_key(name, key or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.stem + ".making"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _lock_is_free(tmp_path, name="flow", key=None) -> bool:
    import fcntl

    path, _ = folder(tmp_path)._path_and_key(name, key or {})
    fd = os.open(path.with_name(path.stem + ".making"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_a_run_waits_for_the_run_making_its_result_and_loads_it(tmp_path, caplog, monkeypatch):
    import fcntl
    import threading

    import pflkit.core.storage.artifacts as artifacts

    monkeypatch.setattr(artifacts, "WAIT_POLL_SECONDS", 0.02)
    other = _hold_lock(tmp_path)     # another run missed the file first and is making it
    maker_counter = Counter()
    maker = folder(tmp_path, counter=maker_counter)
    maker.pending[maker._path_and_key("flow", {})[0].name] = dict(maker_counter.now)
    maker_counter.now = {"calls": 5, "bytes_up": 50, "bytes_down": 70}

    def finish_the_make():
        maker.save("flow", {}, {"w": torch.full((2,), 7.0)})
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)

    timer = threading.Timer(0.3, finish_the_make)
    waiter_counter = Counter()
    waiter = folder(tmp_path, counter=waiter_counter)
    timer.start()
    with caplog.at_level(logging.INFO, logger="pflkit"):
        got = waiter.load("flow", {})
    timer.join()
    assert got is not None and torch.equal(got["w"], torch.full((2,), 7.0))   # not made twice
    assert "another run is making it; waiting" in caplog.text
    assert waiter_counter.replayed == [{"calls": 5, "bytes_up": 50, "bytes_down": 70}] and not waiter.pending
    assert not waiter.making and _lock_is_free(tmp_path)


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_a_make_that_ends_unsaved_passes_to_the_waiting_run(tmp_path, caplog, monkeypatch):
    import fcntl
    import threading

    import pflkit.core.storage.artifacts as artifacts

    monkeypatch.setattr(artifacts, "WAIT_POLL_SECONDS", 0.02)
    other = _hold_lock(tmp_path)

    def maker_dies():  # its process ended: the kernel drops its lock, no file was written
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)

    timer = threading.Timer(0.2, maker_dies)
    waiter = folder(tmp_path)
    timer.start()
    with caplog.at_level(logging.INFO, logger="pflkit"):
        assert waiter.load("flow", {}) is None      # it makes the result now, holding the lock
    timer.join()
    assert "ended without saving it; this run makes it" in caplog.text
    assert not _lock_is_free(tmp_path)
    waiter.save("flow", {}, {"w": torch.zeros(1)})
    assert _lock_is_free(tmp_path) and not waiter.making
    # a make given up without a save (its run ended: the core calls release) frees the lock too
    quitter = folder(tmp_path)
    assert quitter.load("flow", {"seed": 3}) is None and not _lock_is_free(tmp_path, key={"seed": 3})
    quitter.release()
    assert _lock_is_free(tmp_path, key={"seed": 3})


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_runs_of_one_process_never_wait_for_each_other(tmp_path):
    first = folder(tmp_path)
    assert first.load("flow", {}) is None           # holds the make
    second = folder(tmp_path)
    assert second.load("flow", {}) is None          # one process runs its runs in turn: no wait, no deadlock
    first.save("flow", {}, {"w": torch.ones(1)})
    assert folder(tmp_path).load("flow", {}) is not None


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_a_resumed_make_takes_its_lock_again(tmp_path, caplog):
    """A run paused in the middle of a make (its checkpoint keeps ``pending``) holds the make's lock again once
    resumed, so that a run started beside it waits instead of making the result a second time."""
    paused = folder(tmp_path)
    assert paused.load("flow", {}) is None
    pending = dict(paused.pending)
    paused.release()                                   # the run ended (Ctrl-C): the lock is free
    assert _lock_is_free(tmp_path)
    resumed = folder(tmp_path)
    resumed.pending.update(pending)                    # what the core restores from the checkpoint
    resumed.reclaim()
    assert not _lock_is_free(tmp_path) and resumed.making
    resumed.save("flow", {}, {"w": torch.ones(1)})
    assert _lock_is_free(tmp_path) and not resumed.making
    # the checkpoint's names are data: one that is not a result file's name in the folder is never opened
    odd = folder(tmp_path)
    odd.pending.update({"../../escape.pt": {}, "x/y.pt": {}, ".hidden.pt": {}})
    odd.reclaim()
    assert not odd.making and not (tmp_path / "escape.making").exists()
    # another run started the make while this one was paused: both make it (said), nothing is held
    other = _hold_lock(tmp_path, key={"seed": 2})
    late = folder(tmp_path)
    late.pending[late._path_and_key("flow", {"seed": 2})[0].name] = {}
    with caplog.at_level(logging.WARNING, logger="pflkit"):
        late.reclaim()
    os.close(other)
    assert not late.making and "started making it while this run was paused" in caplog.text


def test_the_estimates_measuring_run_shares_the_comparisons_results(tmp_path, monkeypatch):
    """fl reproduce first measures one run per row, which the comparison then resumes: that run must use the
    comparison's OUT/artifacts (else PCFL's measuring run trains the flow its seeds were to load)."""
    import pflkit.core.engine.simulation as simulation
    from pflkit.core.results.estimate import measure_run
    from pflkit.core.testing import resolve

    seen = {}

    class Recorder:
        def __init__(self, cfg, **kwargs):
            seen.update(kwargs)

        def run(self, stop_after=None, on_setup=None):
            return {"rounds_completed": stop_after}

    monkeypatch.setattr(simulation, "Simulation", Recorder)
    run_dir = tmp_path / "out" / "runs" / "pcfl-seed0"
    measure_run(resolve([{"rounds": 5}], algorithm="fedavg"), run_dir)
    assert seen["artifacts_dir"] == tmp_path / "out" / "artifacts" == artifacts_of(run_dir)


def test_a_studys_trials_share_through_the_studys_folder(tmp_path, monkeypatch):
    """fl tune: a trial's run uses STUDY/artifacts, so PCFL's flow (its options are not searched) is trained by the
    first trial and loaded by the others."""
    optuna = pytest.importorskip("optuna")
    import pflkit.core.engine.simulation as simulation
    from pflkit.core.results.tuning import STUDY_NAME, TRIALS_DIR, _storage, run_trial
    from pflkit.core.testing import resolve

    seen = {}

    class Recorder:
        def __init__(self, cfg, **kwargs):
            seen.update(kwargs)

        def run(self, on_round=None):
            return {"rounds_completed": 1}

    monkeypatch.setattr(simulation, "Simulation", Recorder)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name=STUDY_NAME, storage=_storage(url), direction="maximize")
    trial = study.ask()
    run_dir = tmp_path / TRIALS_DIR / "trial-0000"
    run_trial(url, trial._trial_id, "none", resolve([{"rounds": 1}], algorithm="fedavg"), run_dir,
              "val_accuracy/uniform", "best", True)
    assert seen["artifacts_dir"] == tmp_path / "artifacts" == artifacts_of(run_dir)
