"""Processes, signals and limits (issue 21, item 4): bad MASTER_PORT / MASTER_ADDR / timeouts are one line and
exit 2 before any process starts; Ctrl-C at any moment of ``fl run`` (with and without ``--workers``) exits 130
without a traceback and leaves no half-made run directory and no process behind; a client calling sys.exit() is a
failed client; ``failures.client_timeout`` fails a hanging client (and stops a process whose call cannot be
interrupted, resumably); killing the ``--workers`` launcher takes its workers and its folder with it."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from pflkit.core import Algorithm
from pflkit.core.api import registry as reg
from pflkit.core.storage.checkpoint import checkpoint_exists, load_checkpoint
from pflkit.core.engine.comm import ClientAbort
from pflkit.core.engine.simulation import Simulation
from pflkit.core.testing import tiny_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PFLKIT_RENDEZVOUS_TIMEOUT": "120", "PFLKIT_DIST_TIMEOUT": "120"}
TINY_SETS = ["--set", "partition.num_clients=4", "--set", "model.name=mlp", "--set", "model.hidden=[32]",
             "--set", "train.batch_size=32"]
WAIT = 240  # seconds any one process may take here (a loaded 2-core machine starts torch slowly)
# the costlier variants (another start of 2 processes each) run with PFLKIT_SLOW_TESTS=1, as in test_distributed
SLOW = pytest.mark.slow  # skipped unless PFLKIT_SLOW_TESTS=1 (tests/conftest.py)


# -- helpers ------------------------------------------------------------------------------------------------------
def _fl_here(monkeypatch, env: Dict[str, str], *args):
    """``fl`` in this process (for input refused before any process starts)."""
    from click.testing import CliRunner

    from pflkit.core.cli.main import cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _one_line(res, code: int, fragment: str) -> None:
    assert res.exit_code == code, (res.exit_code, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and fragment in lines[0], res.stderr
    assert "Traceback" not in res.output


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _wait_gone(pids: List[int], seconds: float) -> List[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


class _Fl:
    """``fl run ...`` in a subprocess (its own session), read line by line; every process it started is killed on
    exit from the ``with`` block, whatever happened."""

    def __init__(self, args: List[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pflkit.core.cli", "run", "--no-progress", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                     start_new_session=True)
        self.out: List[str] = []
        self.workers: List[int] = []

    def __enter__(self) -> "_Fl":
        return self

    def wait_for(self, fragment: str) -> str:
        """Read stdout up to the line holding ``fragment`` (the run has reached that point)."""
        while True:
            line = self.proc.stdout.readline()
            assert line, f"fl run ended before printing {fragment!r}: {''.join(self.out)}{self.proc.stderr.read()}"
            self.out.append(line)
            m = re.search(r"pids ([\d, ]+)", line)
            if m:
                self.workers = [int(p) for p in m.group(1).split(", ")]
            if fragment in line:
                return line

    def wait_for_torch(self) -> None:
        """Until the process maps libtorch: it is importing torch (pflkit's code runs)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                if "libtorch" in Path(f"/proc/{self.proc.pid}/maps").read_text():
                    return
            except OSError:
                return  # it ended already
            time.sleep(0.01)
        raise AssertionError("fl run did not import torch in time")

    def finish(self):
        out, err = self.proc.communicate(timeout=WAIT)
        return self.proc.returncode, "".join(self.out) + out, err

    def __exit__(self, *exc) -> None:
        for pid in self.workers:  # in their own process groups
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


def _folders(launcher: int) -> List[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"pflkit-workers-{launcher}-*"))


def _register(name: str, behaviour) -> None:
    """Algorithm ``name``: FedAvg whose trainer calls ``behaviour(trainer)`` before each fit."""
    from pflkit_fedavg import FedAvgTrainer

    class Trainer(FedAvgTrainer):
        def on_fit(self, payload):
            behaviour(self)
            return super().on_fit(payload)

    reg.TRAINERS.register(name, Trainer, replace=True)
    reg.ALGORITHMS.register(name, Algorithm(trainer=name, aggregator="fedavg"), replace=True)


def _exits(trainer) -> None:
    if trainer.ctx.cid == 2 and trainer.ctx.round == 1:
        sys.exit(3)


def _interrupts(trainer) -> None:
    if trainer.ctx.cid == 1 and trainer.ctx.round == 2:
        raise KeyboardInterrupt


def _hangs(trainer) -> None:
    if trainer.ctx.cid == 1 and trainer.ctx.round == 2:
        time.sleep(3600)


def _misbehaves(trainer) -> None:
    _exits(trainer)
    _hangs(trainer)


def _ignores_the_timeout(trainer) -> None:
    if trainer.ctx.cid == 1 and trainer.ctx.round == 2:
        end = time.monotonic() + 3600
        while time.monotonic() < end:
            try:
                time.sleep(3600)
            except BaseException:  # swallows ClientTimedOut: only the watchdog can stop this
                pass


@pytest.fixture
def registered():
    before = {k: dict(r._entries) for k, r in reg.ALL_REGISTRIES.items() if r.names() is not None}
    for name, fn in (("exits", _exits), ("interrupts", _interrupts), ("hangs", _hangs),
                     ("stubborn", _ignores_the_timeout), ("misbehaves", _misbehaves)):
        _register(name, fn)
    yield
    for k, r in reg.ALL_REGISTRIES.items():
        if k in before:
            r._entries = before[k]


def _import_lazy_parts() -> None:
    """torch imports its compiler on the first optimizer: done here, so that a slow import (a loaded machine)
    does not make a client's first call outlive the short timeouts of these tests."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _failures(run_dir: Path) -> List[tuple]:
    return [(f["round"], f["client"], f["reason"]) for f in load_checkpoint(run_dir)[1]["failures"]]


# -- bad input: one line, exit 2, nothing started ----------------------------------------------------------------
@pytest.mark.parametrize("env, fragment", [
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000': expected a port number from 1 to 65535"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT='0': expected a port number from 1 to 65535"),
    ({"MASTER_PORT": "-5"}, "MASTER_PORT='-5': expected a port number from 1 to 65535"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port number"),
    ({"MASTER_PORT": "1e3"}, "MASTER_PORT='1e3' is not a port number"),
    ({"MASTER_ADDR": "a" * 300}, "is not an address of this machine"),
    ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid is not an address"),
    ({"PFLKIT_DIST_TIMEOUT": "inf"}, "PFLKIT_DIST_TIMEOUT='inf': expected a number of seconds greater than 0"),
    ({"PFLKIT_DIST_TIMEOUT": "nan"}, "PFLKIT_DIST_TIMEOUT='nan': expected a number of seconds greater than 0"),
    ({"PFLKIT_DIST_TIMEOUT": "1e400"}, "PFLKIT_DIST_TIMEOUT='1e400': expected a number of seconds"),
    ({"PFLKIT_DIST_TIMEOUT": "-3"}, "PFLKIT_DIST_TIMEOUT='-3': expected a number of seconds greater than 0"),
    ({"PFLKIT_RENDEZVOUS_TIMEOUT": "1e12"}, "PFLKIT_RENDEZVOUS_TIMEOUT='1e12': expected a number of seconds"),
])
def test_bad_rendezvous_settings_are_one_line_before_any_process_starts(tmp_path, monkeypatch, env, fragment):
    res = _fl_here(monkeypatch, env, "run", "--plugin", "fedavg", "--workers", "2", *TINY_SETS,
                   "--set", f"output_dir={tmp_path / 'out'}", "--set", "run_name=r")
    _one_line(res, 2, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("env, fragment", [
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000': expected a port number from 1 to 65535"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT='0': expected a port number from 1 to 65535"),
    ({"WORLD_SIZE": str(2 ** 31), "RANK": "0"}, "WORLD_SIZE in [1, 65536]"),
    ({"PFLKIT_DIST_TIMEOUT": "inf"}, "PFLKIT_DIST_TIMEOUT='inf'"),
])
def test_bad_torchrun_variables_are_one_line(tmp_path, monkeypatch, env, fragment):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
           **env}
    res = _fl_here(monkeypatch, env, "run", "--plugin", "fedavg", *TINY_SETS,
                   "--set", f"output_dir={tmp_path / 'out'}", "--set", "run_name=r")
    _one_line(res, 2, fragment)
    assert not (tmp_path / "out").exists()


def test_a_master_port_in_use_and_too_many_workers_are_one_line(tmp_path, monkeypatch):
    out = ["--set", f"output_dir={tmp_path / 'out'}", "--set", "run_name=r"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _fl_here(monkeypatch, {"MASTER_PORT": str(port)}, "run", "--plugin", "fedavg", "--workers", "2",
                       *TINY_SETS, *out)
    _one_line(res, 2, f"MASTER_PORT={port}: cannot listen on 127.0.0.1:{port}")
    monkeypatch.delenv("MASTER_PORT")
    _one_line(_fl_here(monkeypatch, {}, "run", "--plugin", "fedavg", "--workers", str(2 ** 31), *TINY_SETS, *out),
              2, f"--workers {2 ** 31}: expected from 1 to 1024 processes")
    # a resumed run's client count comes from its config.json: 5 processes for 4 clients are refused at once
    run = tmp_path / "done"
    Simulation(tiny_config("fedavg", {"rounds": 1}), run_dir=run, tensorboard=False).run()
    _one_line(_fl_here(monkeypatch, {}, "run", "--workers", "5", "--resume", str(run)), 2,
              "the run has 4 clients; use at most 4")
    assert not (tmp_path / "out").exists()


def test_omp_num_threads_must_be_a_thread_count(tmp_path):
    from pflkit.core.common.threads import env_threads_problem

    assert env_threads_problem("2") is None and env_threads_problem("4,2") is None  # OpenMP's nested form too
    for bad in ("abc", "0", "-1", "1025", "2147483648", "\u00b2", "9" * 5000, "3,,2"):
        assert "expected a number of threads from 1 to 1024" in env_threads_problem(bad), bad
    res = subprocess.run([sys.executable, "-m", "pflkit.core.cli", "run", "--plugin", "fedavg", "--workers", "2",
                          *TINY_SETS, "--set", f"output_dir={tmp_path}"], capture_output=True, text=True,
                         env={**ENV, "OMP_NUM_THREADS": "100000"}, timeout=WAIT)
    assert res.returncode == 2 and res.stderr.strip() == (
        "Error: OMP_NUM_THREADS='100000': expected a number of threads from 1 to 1024 (or unset it: the fl command "
        "then uses 1)"), res.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value, fragment", [("inf", "finite"), ("nan", "finite"), ("-1", "> 0"),
                                             ("1e12", "at most 2592000")])
def test_bad_client_timeouts_are_one_line(tmp_path, monkeypatch, value, fragment):
    res = _fl_here(monkeypatch, {}, "run", "--plugin", "fedavg", *TINY_SETS, "--set",
                   f"failures.client_timeout={value}", "--set", f"output_dir={tmp_path / 'out'}")
    _one_line(res, 2, "failures.client_timeout")
    assert fragment in res.stderr
    assert not (tmp_path / "out").exists()


# -- client code: sys.exit, KeyboardInterrupt, hanging -------------------------------------------------------------
def test_a_client_calling_sys_exit_is_a_failed_client(tmp_path, registered):
    sim = Simulation(tiny_config("exits", {"checkpoint": {"every": 1}}), run_dir=tmp_path / "skip", tensorboard=False)
    assert sim.run()["rounds_completed"] == 2  # the run goes on without it
    assert _failures(tmp_path / "skip") == [(1, 2, "raised SystemExit: client code called sys.exit(3)")]
    abort = Simulation(tiny_config("exits", {"failures": {"on_client_error": "abort"}}), run_dir=tmp_path / "abort",
                       tensorboard=False)
    with pytest.raises(ClientAbort, match=r"client 2 failed in round 1 \('fit'\): SystemExit"):
        abort.run()


def test_a_keyboard_interrupt_in_client_code_still_stops_the_run(tmp_path, registered):
    sim = Simulation(tiny_config("interrupts", {"rounds": 3, "checkpoint": {"every": 1}}), run_dir=tmp_path / "r",
                     tensorboard=False)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert json.loads((tmp_path / "r" / "config.json").read_text())["rounds"] == 3
    resumed = Simulation.resume(tmp_path / "r", tensorboard=False)  # after round 1's checkpoint
    assert resumed.completed_round == 1


def test_client_timeout_fails_a_hanging_client(tmp_path, registered):
    _import_lazy_parts()
    started = time.monotonic()
    sim = Simulation(tiny_config("hangs", {"rounds": 3, "checkpoint": {"every": 1},
                                           "failures": {"client_timeout": 3}}),
                     run_dir=tmp_path / "r", tensorboard=False)
    assert sim.run()["rounds_completed"] == 3
    assert time.monotonic() - started < 120
    assert _failures(tmp_path / "r") == [
        (2, 1, "raised ClientTimeout: did not finish within 3 s (failures.client_timeout)")]


def test_the_timer_raises_inside_the_call_and_waits_for_imports():
    from pflkit.core.common import calltimer

    started = time.monotonic()
    with pytest.raises(calltimer.ClientTimedOut):
        with calltimer.deadline(0.2, lambda: "unused"):
            time.sleep(30)
    assert time.monotonic() - started < 10
    with calltimer.deadline(0.2, lambda: "unused"):  # a call that ends in time is not disturbed
        time.sleep(0.01)
    time.sleep(0.4)  # the timer was disarmed: nothing fires later
    assert calltimer._importing(sys._getframe()) is False


_HUNG_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from pflkit.core.common import calltimer
    calltimer.hard_limit = lambda seconds: seconds + 1.0  # the watchdog acts 1 s after the deadline (test speed)
    import test_hardening_processes as t
    from pflkit.core.engine.simulation import Simulation
    from pflkit.core.testing import tiny_config
    t._register("stubborn", t._ignores_the_timeout)
    t._import_lazy_parts()
    cfg = tiny_config("stubborn", {{"rounds": 3, "checkpoint": {{"every": 1}}, "failures": {{"client_timeout": 2}}}})
    Simulation(cfg, run_dir={run!r}, tensorboard=False).run()
    print("not reached")
""")


def test_a_client_that_ignores_the_timeout_stops_the_process_resumably(tmp_path, registered):
    run = tmp_path / "r"
    script = _HUNG_SCRIPT.format(tests=str(Path(__file__).parent), run=str(run))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=WAIT)
    assert res.returncode == 2, res.stderr
    assert "not reached" not in res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert re.fullmatch(r"Error: client 1 did not return within [\d.]+ s in round 2 \(failures.client_timeout 2 s; "
                        r".*continue from the last checkpoint with: fl run --resume " + re.escape(str(run)),
                        lines[0]), lines[0]
    sim = Simulation.resume(run, overrides={"failures": {"client_timeout": None}}, tensorboard=False)
    assert sim.completed_round == 1  # round 1's checkpoint: the run continues from there


def _timeout_worker(rank: int, world: int, port: int, config: str, out_dir: str) -> None:
    import torch

    from pflkit.core.distributed import worker

    torch.set_num_threads(1)
    _register("misbehaves", _misbehaves)
    _import_lazy_parts()
    rc = worker.run_process(worker.RunRequest(config_file=config, progress=False),
                            worker.Endpoint(rank, world, rank, "127.0.0.1", port))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rc": rc}))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PFLKIT_SLOW_TESTS"), reason="slow: set PFLKIT_SLOW_TESTS=1")
def test_client_timeout_and_sys_exit_in_a_two_process_run(tmp_path, registered):
    """Each rank times its own clients' calls: the hanging client fails on its rank, every rank skips it."""
    import torch.multiprocessing as mp

    from pflkit.core.engine.config import to_plain

    run = tmp_path / "r"
    cfg = tiny_config("misbehaves", {"rounds": 3, "checkpoint": {"every": 1}, "failures": {"client_timeout": 3},
                                     "output_dir": str(tmp_path), "run_name": "r"})
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(to_plain(cfg)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_timeout_worker, args=(2, port, str(config), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + WAIT
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned processes did not finish in time"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["rc"] for r in (0, 1)] == [0, 0]
    assert _failures(run) == [(1, 2, "raised SystemExit: client code called sys.exit(3)"),
                              (2, 1, "raised ClientTimeout: did not finish within 3 s (failures.client_timeout)")]


# -- Ctrl-C ------------------------------------------------------------------------------------------------------
def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "Exception" not in err, err


def test_ctrl_c_while_fl_run_starts_exits_130_and_leaves_nothing(tmp_path):
    """SIGINT during the imports and at growing delays into the start-up (serial): 130, one line, no directory,
    or -- when the run got that far -- a run that checkpointed and says how to resume."""
    for k, delay in enumerate([0.0, 2.0]):
        run = tmp_path / f"r{k}"
        with _Fl(["--plugin", "fedavg", *TINY_SETS, "--set", "rounds=200", "--set", "checkpoint.every=1",
                  "--set", f"output_dir={tmp_path}", "--set", f"run_name=r{k}"]) as fl:
            fl.wait_for_torch()
            time.sleep(delay)
            fl.proc.send_signal(signal.SIGINT)
            code, out, err = fl.finish()
        _no_traceback(err)
        assert code == 130, (delay, code, err)
        if run.exists():  # it had started: a round finished and checkpointed
            assert checkpoint_exists(run) and f"fl run --resume {run}" in out, (delay, out, err)
        else:
            assert len(err.strip().splitlines()) == 1, err  # "interrupted during start-up; nothing was run"


@pytest.mark.parametrize("argv, status", [(["list", "algorithms"], 0), (["run", "--plugin", "no-such-plugin"], 2)])
def test_a_handled_ctrl_c_inside_exec_keeps_the_commands_exit_status(tmp_path, argv, status):
    """A Ctrl-C that lands while an import runs ``exec`` of a string (a dataclass building its methods) and that the
    command catches must not turn ``python -m pflkit.core.cli``'s exit status into death by SIGINT (-2): CPython
    notes such an interrupt as unhandled (the flaky 130-or--2 of the test above)."""
    (tmp_path / "fl_after_a_caught_interrupt.py").write_text(
        "import sys\n"
        "from pflkit.core.cli import main as fl\n"
        "command = fl.cli.main\n"
        "def command_that_caught_a_ctrl_c(*args, **kwargs):\n"
        "    try:\n"
        "        return command(*args, **kwargs)\n"
        "    finally:  # its last import built a dataclass as a Ctrl-C came, and the command caught it\n"
        "        try:\n"
        "            exec('raise KeyboardInterrupt')\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
        "fl.cli.main = command_that_caught_a_ctrl_c\n"
        f"sys.argv = ['fl', *{argv!r}]\n"
        "fl.main()\n")
    done = subprocess.run([sys.executable, "-m", "fl_after_a_caught_interrupt"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == status, (done.returncode, done.stderr)


def test_ctrl_c_during_a_workers_start_and_run(tmp_path):
    """--workers 2: Ctrl-C as the workers start (they ignore SIGINT until their handler is set; the launcher
    forwards it), then Ctrl-C once the run is under way (finish the round, checkpoint, 130). No worker survives,
    the launcher's folder goes, and a start that was stopped leaves no run directory."""
    base = ["--plugin", "fedavg", "--workers", "2", *TINY_SETS, "--set", "rounds=200", "--set", "checkpoint.every=1",
            "--set", f"output_dir={tmp_path}"]
    with _Fl([*base, "--set", "run_name=early"]) as fl:
        fl.wait_for("workers:")
        fl.proc.send_signal(signal.SIGINT)
        code, out, err = fl.finish()
        assert not _wait_gone(fl.workers, 30)
    _no_traceback(err)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted during start-up; nothing was run", err
    assert not (tmp_path / "early").exists() and not _folders(fl.proc.pid)

    with _Fl([*base, "--set", "run_name=late"]) as fl:
        fl.wait_for("run directory:")
        deadline = time.monotonic() + WAIT
        while not checkpoint_exists(tmp_path / "late"):  # under way: round 1 is done
            assert time.monotonic() < deadline and fl.proc.poll() is None
            time.sleep(0.05)
        fl.proc.send_signal(signal.SIGINT)
        code, out, err = fl.finish()
        assert not _wait_gone(fl.workers, 30)
    _no_traceback(err)
    assert code == 130, err
    assert f"continue with:\n  fl run --resume {tmp_path / 'late'}" in out, out
    assert checkpoint_exists(tmp_path / "late") and not _folders(fl.proc.pid)


# -- the launcher's death ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=SLOW)], ids=["SIGKILL", "SIGTERM"])
def test_killing_the_launcher_takes_its_workers_and_folder_with_it(tmp_path, sig):
    with _Fl(["--plugin", "fedavg", "--workers", "2", *TINY_SETS, "--set", "rounds=200", "--set", "checkpoint.every=1",
              "--set", f"output_dir={tmp_path}", "--set", "run_name=k"]) as fl:
        fl.wait_for("workers:")
        assert len(_folders(fl.proc.pid)) == 1 and len(fl.workers) == 2
        fl.wait_for("run directory:")
        os.kill(fl.proc.pid, sig)
        code, _, err = fl.finish()
        assert not _wait_gone(fl.workers, 60), "a worker outlived its launcher"
        deadline = time.monotonic() + 10
        while _folders(fl.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _folders(fl.proc.pid)
    assert code == -sig if sig == signal.SIGKILL else code == 143, (code, err)
    _no_traceback(err)
    run = tmp_path / "k"
    # nothing half-made: removed, resumable, or (its rounds had started) a kept record saying how it stopped
    assert not run.exists() or checkpoint_exists(run) or \
        json.loads((run / "summary.json").read_text())["status"] in ("interrupted", "failed")


def test_a_folder_left_by_a_dead_launcher_is_removed_at_the_next_start(tmp_path):
    from pflkit.core.distributed.launch import FOLDER_PREFIX, _remove_stale_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = Path(tempfile.gettempdir())
    stale = root / f"{FOLDER_PREFIX}{dead.pid}-test"
    live = root / f"{FOLDER_PREFIX}{os.getpid()}-test"
    try:
        for folder in (stale, live):
            folder.mkdir()
            (folder / "rank0.json").write_text("{}")
        _remove_stale_folders()
        assert not stale.exists() and live.exists()
    finally:
        for folder in (stale, live):
            if folder.exists():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
