"""``fl run --workers N``: start N local processes with torch's launcher (``torch.multiprocessing``), wait for
them, and turn a process that died into one message naming its rank and clients."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import click

from ..errors import ConfigError, PflError
from .worker import INTERRUPTED, USER_ERROR, Endpoint, RunRequest, run_process

LOCALHOST = "127.0.0.1"


class WorkerDied(PflError):
    """A process of an ``fl run --workers`` run ended abnormally (killed, crashed)."""


def _local_address() -> str:
    """MASTER_ADDR when set (it must be this machine: the workers are local processes), else 127.0.0.1."""
    addr = os.environ.get("MASTER_ADDR") or LOCALHOST
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError as exc:
        raise ConfigError(f"MASTER_ADDR={addr} is not an address of this machine ({exc.strerror or exc}); "
                          f"fl run --workers starts local processes only (use torchrun for several machines)") \
            from None
    return addr


def _port(addr: str) -> int:
    text = os.environ.get("MASTER_PORT")
    if text:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"MASTER_PORT={text!r} is not a port number") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a free port, released for rank 0's store
        s.bind((addr, 0))
        return s.getsockname()[1]


def _check_before_start(req: RunRequest) -> Optional[int]:
    """Reports bad input before any process starts (every process checks it again, exactly); returns the run's
    client count when the configuration states it."""
    from ..config import load_file, parse_sets, resolve
    from ..simulation import resolve_device
    from .backend import device_collective_backend

    if req.resume_dir:
        return None
    layers = [load_file(req.config_file)] if req.config_file else []
    layers.append(parse_sets(req.sets))
    if req.plugin is None and not any("algorithm" in layer for layer in layers):
        raise ConfigError("name an algorithm: fl run --plugin NAME (fl list algorithms shows them)")
    cfg = resolve(layers, algorithm=req.plugin)  # bad input is reported here, before any process starts
    device_collective_backend(cfg.get("distributed", {}).get("backend", "auto"), resolve_device(cfg.device))
    n = cfg.get("partition", {}).get("num_clients")
    return int(n) if isinstance(n, int) else None


def _entry(index: int, req: RunRequest, world: int, addr: str, port: int) -> None:
    """A spawned worker: rank ``index`` of ``world``."""
    from ..threads import apply_cli_default

    apply_cli_default()
    logging.basicConfig(level=logging.DEBUG if req.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(run_process(req, Endpoint(index, world, index, addr, port)))


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

    if workers < 1:
        raise ConfigError(f"--workers {workers}: expected at least 1 process")
    n = _check_before_start(req)
    if n is not None and workers > n:
        raise ConfigError(f"--workers {workers}: the run has {n} clients; use at most {n} processes (each runs at "
                          f"least one client)")
    addr = _local_address()
    port = _port(addr)
    status_dir = Path(tempfile.mkdtemp(prefix="pflkit-workers-"))
    req.status_dir = str(status_dir)
    try:
        ctx = mp.start_processes(_entry, args=(req, workers, addr, port), nprocs=workers, join=False,
                                 start_method="spawn")
        click.echo(f"workers: {workers} processes on {addr}:{port} (pids {', '.join(map(str, ctx.pids()))})")
        interrupted_at = None
        while True:
            try:
                if ctx.join(grace_period=5):
                    return 0
            except KeyboardInterrupt:
                # the workers got the same Ctrl-C: they finish the round and checkpoint; a second one stops them
                if interrupted_at is not None:
                    raise
                interrupted_at = time.monotonic()
            except ProcessExitedException as exc:
                if exc.signal_name is None and exc.exit_code in (USER_ERROR, INTERRUPTED):
                    return exc.exit_code  # the worker printed why
                who, run_dir = _describe_rank(status_dir, exc.error_index)
                how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with status {exc.exit_code}"
                resume = f"; continue from the last checkpoint with: fl run --resume {run_dir}" if run_dir else ""
                raise WorkerDied(f"worker {who} {how}; the other workers were stopped{resume}") from None
            except ProcessRaisedException as exc:  # a bug in a worker: its traceback, then one line
                click.echo(str(exc), err=True)
                who, _ = _describe_rank(status_dir, exc.error_index)
                raise WorkerDied(f"worker {who} failed (traceback above); the other workers were stopped") from None
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
