"""``fl run --workers N``: start N local processes with torch's launcher (``torch.multiprocessing``), wait for
them, and turn a process that died into one message naming its rank and clients. How they stop (Ctrl-C, SIGTERM,
the launcher's death): ``signals``."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import click

from ..common.errors import ConfigError, PflError
from .signals import (TERMINATED, Terminated, install_worker_handlers, interrupt_requested, note_interrupt,
                      raise_on_sigterm)
from .worker import INTERRUPTED, USER_ERROR, Endpoint, RunRequest, check_timeouts, parse_port, run_process

LOCALHOST = "127.0.0.1"
MAX_LOCAL_WORKERS = 1024  # local processes of one fl run --workers
FOLDER_PREFIX = "pflkit-workers-"  # + the launcher's pid: a folder whose launcher is gone is removed at the next start


class WorkerDied(PflError):
    """A process of an ``fl run --workers`` run ended abnormally (killed, crashed)."""


def _local_address() -> str:
    """MASTER_ADDR when set (it must be this machine: the workers are local processes), else 127.0.0.1."""
    addr = os.environ.get("MASTER_ADDR") or LOCALHOST
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except (OSError, ValueError) as exc:  # ValueError: a name that cannot be encoded (idna)
        raise ConfigError(f"MASTER_ADDR={addr} is not an address of this machine ({exc.strerror or exc}); "
                          f"fl run --workers starts local processes only (use torchrun for several machines)") \
            from None
    return addr


def _port(addr: str) -> int:
    """MASTER_PORT when set (it must be free here: rank 0's store listens on it), else a free port."""
    text = os.environ.get("MASTER_PORT")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the port is released for rank 0's store
        if text:
            port = parse_port(text)
            try:
                s.bind((addr, port))
            except OSError as exc:
                raise ConfigError(f"MASTER_PORT={port}: cannot listen on {addr}:{port} "
                                  f"({exc.strerror or exc}); choose a free port, or unset MASTER_PORT") from None
            return port
        s.bind((addr, 0))
        return s.getsockname()[1]


def _resumed_clients(run_dir: str) -> Optional[int]:
    """The client count in a run directory's config.json (None when unreadable: the workers then report it)."""
    from ..storage.rundata import config_value, read_config

    try:
        n = config_value(read_config(Path(run_dir)) or {}, "partition.num_clients")
    except (PflError, KeyError, OSError, ValueError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _check_before_start(req: RunRequest) -> Optional[int]:
    """Reports bad input before any process starts (every process checks it again, exactly); returns the run's
    client count when the configuration states it."""
    from ..engine.config import load_file, parse_sets, resolve
    from ..engine.simulation import resolve_device
    from .backend import device_collective_backend

    check_timeouts()
    if req.resume_dir:
        return _resumed_clients(req.resume_dir)
    layers = [load_file(req.config_file)] if req.config_file else []
    layers.append(parse_sets(req.sets))
    if req.plugin is None and not any("algorithm" in layer for layer in layers):
        raise ConfigError("name an algorithm: fl run --plugin NAME (fl list algorithms shows them)")
    cfg = resolve(layers, algorithm=req.plugin)  # bad input is reported here, before any process starts
    device_collective_backend(cfg.get("distributed", {}).get("backend", "auto"), resolve_device(cfg.device))
    n = cfg.get("partition", {}).get("num_clients")
    return int(n) if isinstance(n, int) else None


def _entry(index: int, req: RunRequest, world: int, addr: str, port: int, launcher: int) -> None:
    """A spawned worker: rank ``index`` of ``world``, started by process ``launcher`` (it ignores SIGINT until
    its handlers are in place: a Ctrl-C while it imports is the launcher's to forward)."""
    from ..common.threads import apply_cli_default

    try:
        os.setpgid(0, 0)  # a Ctrl-C in the terminal reaches the launcher only, which forwards it once (signals.py)
    except OSError:
        pass
    try:
        install_worker_handlers(launcher, req.status_dir)
        if interrupt_requested(req.status_dir):  # a Ctrl-C came while this process was starting
            sys.exit(INTERRUPTED)
        apply_cli_default()
        logging.basicConfig(level=logging.DEBUG if req.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        code = run_process(req, Endpoint(index, world, index, addr, port))
    except Terminated:
        code = TERMINATED
    except KeyboardInterrupt:  # outside run_process's own handling: nothing to report
        code = INTERRUPTED
    sys.exit(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _remove_stale_folders() -> None:
    """Folders of launchers that are gone (killed before they could remove theirs, e.g. by SIGKILL)."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(FOLDER_PREFIX + "*"):
        m = re.fullmatch(re.escape(FOLDER_PREFIX) + r"(\d+)-\w+", path.name)
        try:
            mine = not path.is_symlink() and path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


class _Interrupts:
    """The launcher's SIGINT handler: forward each Ctrl-C to the workers (noted first, for a worker still
    starting); the third kills them."""

    def __init__(self, status_dir: Path) -> None:
        self.status_dir = status_dir
        self.count = 0
        self.pids: List[int] = []

    def __call__(self, signum, frame) -> None:
        self.count += 1
        note_interrupt(self.status_dir, self.count)
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL if self.count >= 3 else signal.SIGINT)
            except OSError:
                pass


def _describe_rank(status_dir: Path, rank: int) -> Tuple[str, Optional[str]]:
    """('rank R (clients ...)', its run directory) from the note the worker left at start-up."""
    try:
        info = json.loads((status_dir / f"rank{rank}.json").read_text())
        return f"rank {rank} (clients {', '.join(map(str, info['clients']))})", info.get("run_dir")
    except (OSError, ValueError, KeyError):
        return f"rank {rank} (its clients were not assigned yet)", None


def launch_local(req: RunRequest, workers: int) -> int:
    """Run ``req`` with ``workers`` local processes; returns the exit status for ``fl run``."""
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    if not 1 <= workers <= MAX_LOCAL_WORKERS:
        raise ConfigError(f"--workers {workers}: expected from 1 to {MAX_LOCAL_WORKERS} processes")
    n = _check_before_start(req)
    if n is not None and workers > n:
        raise ConfigError(f"--workers {workers}: the run has {n} clients; use at most {n} processes (each runs at "
                          f"least one client)")
    addr = _local_address()
    port = _port(addr)
    _remove_stale_folders()
    status_dir = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    req.status_dir = str(status_dir)
    interrupts = _Interrupts(status_dir)
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    ctx = None
    try:
        signal.signal(signal.SIGTERM, raise_on_sigterm)  # the finally below runs; the workers follow (signals.py)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: a worker ignores Ctrl-C until its handler is set
        try:
            ctx = mp.start_processes(_entry, args=(req, workers, addr, port, os.getpid()), nprocs=workers,
                                     join=False, start_method="spawn")
        finally:
            interrupts.pids = ctx.pids() if ctx is not None else []
            signal.signal(signal.SIGINT, interrupts)
        click.echo(f"workers: {workers} processes on {addr}:{port} (pids {', '.join(map(str, ctx.pids()))})")
        while True:
            try:
                if ctx.join(grace_period=5):
                    return 0
            except ProcessExitedException as exc:
                started = any(status_dir.glob("rank*.json"))  # each rank notes its clients once started
                if interrupts.count and exc.exit_code == INTERRUPTED and not started:
                    click.echo("interrupted during start-up; nothing was run", err=True)
                    return INTERRUPTED
                if exc.signal_name is None and exc.exit_code in (USER_ERROR, INTERRUPTED):
                    return exc.exit_code  # the worker printed why
                who, run_dir = _describe_rank(status_dir, exc.error_index)
                if interrupts.count:  # stopped by a signal after Ctrl-C (the launcher killed it, or SIGTERM)
                    click.echo(_stop_hint(run_dir), err=True)
                    return INTERRUPTED
                how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with status {exc.exit_code}"
                resume = f"; continue from the last checkpoint with: fl run --resume {run_dir}" if run_dir else ""
                raise WorkerDied(f"worker {who} {how}; the other workers were stopped{resume}") from None
            except ProcessRaisedException as exc:  # a bug in a worker: its traceback, then one line
                click.echo(str(exc), err=True)
                who, _ = _describe_rank(status_dir, exc.error_index)
                raise WorkerDied(f"worker {who} failed (traceback above); the other workers were stopped") from None
    except Terminated:
        return TERMINATED
    except KeyboardInterrupt:  # before the workers started (the handler above forwards every later one)
        click.echo("interrupted during start-up; nothing was run", err=True)
        return INTERRUPTED
    finally:
        for signum, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signum, handler)
        if ctx is not None:  # e.g. SIGTERM: do not leave them running (their own watchdog would stop them too)
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        shutil.rmtree(status_dir, ignore_errors=True)


def _stop_hint(run_dir: Optional[str]) -> str:
    from ..storage.checkpoint import checkpoint_exists

    if run_dir and checkpoint_exists(Path(run_dir)):
        return f"stopped; continue from the last checkpoint with: fl run --resume {run_dir}"
    return "stopped before the first checkpoint; nothing to resume"
