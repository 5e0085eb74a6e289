"""A run directory belongs to one process at a time: an advisory lock held for the run's lifetime.

The lock is ``fcntl.flock`` on ``RUN_DIR/.lock``: the kernel releases it when the holding process exits, however
it exits (even SIGKILL), so a stale lock file never blocks a later run. The file records who holds it, for the
message a second process gets; it is opened without following a link (a ``.lock`` link planted in a shared run
directory is refused, its target left untouched). Platforms without ``fcntl`` run without the lock.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .errors import CheckpointError
from .safefiles import RunFileError, open_rw

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"


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
