"""``failures.client_timeout``: a deadline for each client call.

At the deadline a timer signal (SIGALRM) raises ``ClientTimedOut`` inside the call, which the backend reports as
a failed client (skipped or aborting, as ``failures.on_client_error`` says; its state rolled back). A signal
reaches Python code only between two bytecodes: a call stuck inside one long C operation (a deadlocked kernel, a
blocking read that retries) or code that catches and ignores the exception cannot be stopped that way, and a
thread cannot be killed. For those a watchdog thread ends the whole process after a second grace period
(``hard_limit``), printing one line that names the client and round; the run directory keeps its last checkpoint
and resumes from it. Neither acts while the call is importing a module (torch imports parts of itself on first
use, slowly on a loaded machine, and an import cut short leaves a half-made module behind): they act when the
import is done, so a call that hangs inside an import is not stopped. The deadline needs the main thread of a
POSIX process (the ``fl`` command and every worker of ``fl run --workers`` run the loop there); elsewhere it is
not enforced and a warning says so once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

log = logging.getLogger("pflkit")

HUNG_EXIT = 2  # the status of a process stopped because a client call hung
_RETRY_SECONDS = 0.05  # the timer fired during an import: try again this much later
_warned = False


class ClientTimedOut(BaseException):
    """Raised inside a client call that outlived its deadline. A BaseException, so trainer code that catches
    ``Exception`` does not swallow it."""


def hard_limit(seconds: float) -> float:
    """When a call that ignored ``ClientTimedOut`` ends the process: twice the deadline, at least 5 s later."""
    return seconds + max(seconds, 5.0)


class _Watchdog:
    """One daemon thread that ends the process when the current call passes its hard limit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._call: Optional[tuple] = None  # (token, hard deadline on the monotonic clock, message)
        self._thread: Optional[threading.Thread] = None

    def arm(self, token: object, hard_at: float, message: Callable[[], str]) -> None:
        with self._cond:
            self._call = (token, hard_at, message)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pflkit-client-timeout", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, token: object) -> None:
        with self._cond:
            if self._call is not None and self._call[0] is token:
                self._call = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._call is None:
                    self._cond.wait()
                    continue
                _, hard_at, message = self._call
                left = hard_at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                if _importing(sys._current_frames().get(threading.main_thread().ident)):
                    self._cond.wait(_RETRY_SECONDS)  # as the timer: never cut an import short
                    continue
                try:
                    sys.stderr.write(f"Error: {message()}\n")
                    sys.stderr.flush()
                finally:
                    os._exit(HUNG_EXIT)


_watchdog = _Watchdog()


def _importing(frame) -> bool:
    """Whether the interrupted code is inside an import (torch imports parts of itself on first use)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: Optional[float], hung_message: Callable[[], str]) -> Iterator[None]:
    """Raise ``ClientTimedOut`` in the block after ``seconds`` (None: no deadline); end the process with the line
    ``hung_message()`` (which names the client, the round and how to resume; called by the watchdog thread) when
    the block outlives ``hard_limit(seconds)``."""
    global _warned
    if seconds is None:
        yield
        return
    if not _usable():
        if not _warned:
            _warned = True
            log.warning("failures.client_timeout is not enforced: the run's loop is not in the main thread of its "
                        "process (a timer signal can only interrupt the main thread)")
        yield
        return
    state = {"active": True}
    token = object()

    def on_alarm(signum, frame):
        if not state["active"]:
            return
        if _importing(frame):  # an exception inside an import leaves the module half made: wait until it is done
            signal.setitimer(signal.ITIMER_REAL, _RETRY_SECONDS)
            return
        state["active"] = False  # once: the client's clean-up code may run on
        raise ClientTimedOut()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    _watchdog.arm(token, time.monotonic() + hard_limit(seconds), hung_message)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        state["active"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)
        _watchdog.disarm(token)
