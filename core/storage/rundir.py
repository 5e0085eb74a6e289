"""The run directory of one start: named, created or reused, locked, cleaned, given its start files, and given up
(removed when this start created it and nothing was saved) after a start that failed before its first round; a run
that fails or is stopped during its rounds keeps its directory and records why (core/engine/rounds.py).

Every file operation goes through ``safefiles`` (no link followed, atomic rewrites, bounded reads); this module
decides *which* entries a run directory may hold and what a start does with them.

One process per run directory: an advisory lock held for the run's lifetime, ``fcntl.flock`` on ``RUN_DIR/.lock``.
The kernel releases it when the holding process exits, however it exits (even SIGKILL), so a stale lock file never
blocks a later run. The file records who holds it, for the message a second process gets; it is opened without
following a link (a ``.lock`` link planted in a shared run directory is refused, its target left untouched).
Platforms without ``fcntl`` run without the lock.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any, List, Optional

from .checkpoint import CHECKPOINT_NAME, checkpoint_exists, remove_orphaned_temporaries
from ..api.clientstate import SPILL_DIR
from ..data.data import ClientSplit, FederatedData
from ..common.errors import CheckpointError, DataError, PflError
from ..common.safefiles import (RunFileError, check_run_dir, open_rw, read_regular, remove_temporaries, unlink_entry,
                                write_atomic)
from ..api.serverstore import SERVER_SPILL_DIR

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("pflkit")

LOCK_NAME = ".lock"
# What a run directory holds before its first checkpoint (besides checkpoint temporaries)
START_ARTEFACTS = {LOCK_NAME, "config.json", "partition.json", "metrics.jsonl", "summary.json", "run.log",
                   "run_info.json", "run_info.json.tmp", "resumes.jsonl", "tb"}
# pflkit's own files and folders in a run directory: each must be a regular file / a real directory of regular
# files, never a link or a FIFO planted there (a resume or a reusing start would write through it)
RUN_FILES = (LOCK_NAME, "config.json", "partition.json", "metrics.jsonl", "summary.json", "run.log", "run_info.json",
             "resumes.jsonl", CHECKPOINT_NAME)
RUN_DIRS = ("tb", SPILL_DIR, SERVER_SPILL_DIR)
MAX_CONFIG_BYTES = 16 << 20


def default_run_dir(cfg: Any) -> Path:
    """``output_dir/run_name``; without a run_name, ``<algorithm>-<dataset>-<time>`` made unique with a suffix."""
    if cfg.run_name:
        return Path(cfg.output_dir) / cfg.run_name
    base = Path(cfg.output_dir) / f"{cfg.algorithm}-{cfg.dataset.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_own_entries(run_dir: Path) -> None:
    """Refuse (one line naming it) a run directory where one of pflkit's own files or folders is a link, FIFO or
    device: called before a resume or a start reusing the directory writes anything."""
    check_run_dir(run_dir, RUN_FILES, RUN_DIRS)


def read_config_bytes(run_dir: Path) -> bytes:
    """The raw ``config.json`` of a run directory (a regular file, at most ``MAX_CONFIG_BYTES``)."""
    return read_regular(Path(run_dir) / "config.json", MAX_CONFIG_BYTES)


def _readable_config(path: Path) -> bool:
    try:
        return isinstance(json.loads(read_config_bytes(path).decode("utf-8")), dict)
    except (OSError, ValueError, PflError):
        return False


def is_dead_start(path: Path) -> bool:
    """A run directory left by a start that was killed before it had anything to resume: no checkpoint, no
    readable config.json, and nothing but pflkit's own start-up files. A new start may reuse it (after
    ``check_own_entries``)."""
    if not path.is_dir() or path.is_symlink() or os.path.lexists(path / CHECKPOINT_NAME) or _readable_config(path):
        return False
    return all(p.name in START_ARTEFACTS or p.name in (SPILL_DIR, SERVER_SPILL_DIR) or p.name.endswith(".tmp")
               for p in path.iterdir())


def missing_parents(path: Path) -> List[Path]:
    """The folders above ``path`` that do not exist yet, deepest first (what creating ``path`` would add)."""
    out = []
    for parent in Path(path).absolute().parents:
        if os.path.lexists(parent):
            break
        out.append(parent)
    return out


def remove_empty_folders(folders: List[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: the parents a failed start created, never one
    another process has put something into meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def prepare_run_dir(path: Path, exist_ok: bool = False) -> Path:
    if exist_ok and not path.is_dir():
        raise CheckpointError(f"{path} is not a run directory")
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError as exc:
        raise CheckpointError(f"run directory {path} already exists; choose another run_name, or resume it with "
                              f"'fl run --resume {path}'") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot create run directory {path}: {exc.strerror}") from exc
    if not os.access(path, os.W_OK):
        raise CheckpointError(f"run directory {path} is not writable")
    return path


def saved_splits(run_dir: Path, restart: bool) -> Optional[List[ClientSplit]]:
    """The partition a run directory holds (``partition.json``), or None when it holds none. A ``restart`` (a run
    with no checkpoint: nothing was computed on its partition yet) makes a damaged one again from its
    configuration instead of refusing it."""
    path = Path(run_dir) / "partition.json"
    if not path.exists():
        return None
    try:
        return FederatedData.load_splits(path)
    except DataError:
        if not restart:
            raise
        # nothing was computed on it yet: the configuration makes the same partition again
        log.warning("%s is damaged and the run has no checkpoint: making its partition again from its "
                    "configuration", path)
        return None


def write_config(run_dir: Path, plain_cfg: Any) -> None:
    """``config.json``: the configuration in force (plain data), rewritten atomically."""
    write_atomic(Path(run_dir) / "config.json", json.dumps(plain_cfg, indent=2))


class RunDirectory:
    """One start's hold on its run directory.

    ``reuse``: a resume or a restart continues in the directory. A fresh start creates it, or reuses one a start
    killed before it wrote its configuration left behind (``dead_start``). Only the writer (rank 0 of a
    distributed run) touches the directory; the other processes use the one rank 0 prepared, and only read it.
    Nothing is written until ``take``.
    """

    def __init__(self, path: Path, reuse: bool, is_writer: bool = True):
        self.is_writer = is_writer
        # a directory left by a start killed before it wrote its configuration holds nothing to resume: reuse it
        self.dead_start = is_writer and not reuse and is_dead_start(path)
        if is_writer and (reuse or self.dead_start):
            check_own_entries(path)  # nothing is written through a link planted in a reused directory
        if self.dead_start:
            log.warning("%s holds no run (no configuration, no checkpoint: a start stopped early): reusing it", path)
        self.created = is_writer and not reuse and not self.dead_start  # never remove one another start holds
        # the folders above it this start creates (output_dir, e.g. runs/): a failed start removes them when empty
        self.created_parents = missing_parents(path) if self.created else []
        self.path = prepare_run_dir(path, exist_ok=reuse or self.dead_start) if is_writer else path
        self.lock = RunDirLock(self.path)

    def take(self, from_round_zero: bool) -> None:
        """Lock the directory and clear what a killed process left there: temporaries of interrupted writes and,
        when the run starts over at round 0 in a reused directory (``from_round_zero``, or a dead start), the
        metrics, summary and TensorBoard files of the earlier attempt."""
        if not self.is_writer:
            return
        self.lock.acquire()
        remove_orphaned_temporaries(self.path)
        remove_temporaries(self.path, RUN_FILES)  # of a rewrite that was killed
        if from_round_zero or self.dead_start:
            for name in ("metrics.jsonl", "summary.json"):
                unlink_entry(self.path / name)
            shutil.rmtree(self.path / "tb", ignore_errors=True)  # checked: a real directory

    def write_start_files(self, plain_cfg: Any, data: Any) -> None:
        """``config.json`` and ``partition.json``: what a resume needs to rebuild the run (``data``: the run's
        ``FederatedData``)."""
        if self.is_writer:
            write_config(self.path, plain_cfg)
            data.save(self.path / "partition.json")

    def abandon(self) -> None:
        """Give the directory up after a start that failed before its rounds began: release the lock and, when this
        start created the directory and no checkpoint exists yet, remove it (a failed start leaves nothing
        half-made behind). A run that failed during its rounds keeps its directory: ``RoundLoop.run`` records the
        failure there and calls ``release`` instead."""
        self.lock.release()
        if self.created and not checkpoint_exists(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
            remove_empty_folders(self.created_parents)

    def release(self) -> None:
        self.lock.release()


class RunDirLock:
    """Exclusive, non-blocking lock of a run directory (``acquire`` raises CheckpointError when it is taken)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self) -> "RunDirLock":
        if fcntl is None or self._fd is not None:
            return self
        try:
            fd = open_rw(self.path)  # never through a link: the lock file is truncated and written below
        except RunFileError:
            raise
        except OSError as exc:
            raise CheckpointError(f"cannot create the lock file {self.path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise CheckpointError(f"run directory {self.path.parent} is in use by another fl process{holder}; wait "
                                  f"for it to finish or stop it, then try again") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self) -> None:  # a Simulation dropped without finishing must not keep its directory locked
        try:
            self.release()
        except Exception:
            pass


def _describe_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f" (pid {info['pid']} on {info['host']}, since {info['since']})"
    except Exception:
        return ""
