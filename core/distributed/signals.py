"""How the processes of ``fl run --workers N`` stop: Ctrl-C, SIGTERM and the launcher's death.

The workers run in their own process group, so a Ctrl-C typed in the terminal reaches the launcher only; the
launcher forwards each Ctrl-C to every worker and notes it in its folder first, so a worker that was still
starting (it ignores SIGINT until its handler is in place) reads the note and stops too. First Ctrl-C: the run
finishes its round (during set-up: its set-up step), checkpoints and stops; second: it stops at once; third: the
launcher kills the workers.

A worker stops at once, quietly and keeping the last checkpoint, on SIGTERM (the launcher's ``ProcessContext``
sends it to the others after one failed) and when its launcher dies (SIGKILL included): the kernel sends SIGTERM
(``PR_SET_PDEATHSIG`` on Linux) and a watchdog thread notices the new parent elsewhere; the first worker to notice
removes the launcher's folder.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

INTERRUPT_NOTE = "interrupt"  # in the launcher's folder: how many Ctrl-C it forwarded
TERMINATED = 143  # the shell's status for a process stopped by SIGTERM
_PR_SET_PDEATHSIG = 1
_WATCH_SECONDS = 0.5  # how often a worker checks that its launcher is alive
_EXIT_GRACE = 10.0  # seconds an orphaned worker may take to unwind (remove a fresh run directory) before it exits

_orphaned = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM or the launcher's death: stop now. A KeyboardInterrupt, so every layer that lets Ctrl-C through (the
    client call wrapper, the simulation's clean-up) lets this through too."""


def orphaned() -> bool:
    """Whether this worker's launcher is gone (nobody reads what the worker prints any more)."""
    return _orphaned.is_set()


def note_interrupt(status_dir: Path, count: int) -> None:
    """The launcher's record of a forwarded Ctrl-C (written before the signal is sent)."""
    try:
        (Path(status_dir) / INTERRUPT_NOTE).write_text(str(count))
    except OSError:
        pass


def interrupt_requested(status_dir: Optional[str]) -> bool:
    return bool(status_dir) and (Path(status_dir) / INTERRUPT_NOTE).exists()


def raise_on_sigterm(signum=None, frame=None) -> None:
    """A SIGTERM handler: stop now, unwinding (a fresh run directory without a checkpoint is removed)."""
    raise Terminated()


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent (the launcher) ends, however it ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog thread still notices


def install_worker_handlers(launcher_pid: int, status_dir: Optional[str]) -> None:
    """In a spawned worker, before any work: SIGINT raises KeyboardInterrupt (the simulation turns the first into
    'finish the round' or, during set-up, 'finish the set-up step'), SIGTERM raises ``Terminated``, and the
    launcher's death stops this process."""
    def gone() -> bool:
        return os.getppid() != launcher_pid

    def orphan() -> None:
        _orphaned.set()
        if status_dir:
            shutil.rmtree(status_dir, ignore_errors=True)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the process is unwinding
        if gone():
            orphan()
        raise Terminated()

    def watch() -> None:
        while not gone():
            time.sleep(_WATCH_SECONDS)
        orphan()
        os.kill(os.getpid(), signal.SIGTERM)  # the main thread unwinds (on_term), unless it is stuck in C code
        time.sleep(_EXIT_GRACE)
        os._exit(TERMINATED)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)
    _die_with_parent()
    threading.Thread(target=watch, name="pflkit-launcher-watch", daemon=True).start()
    if gone():  # the launcher died before the handlers were in place
        orphan()
        raise Terminated()
