"""Ctrl-C while the ``fl`` command starts: importing torch and the core takes seconds, and a KeyboardInterrupt in
the middle of an import would end the command with a traceback. Imported first by ``pflkit.core``; only in the
``fl`` command (its console script, ``python -m pflkit.core.cli`` or torchrun's ``-m pflkit.core.cli``) does it
make a Ctrl-C before the command runs exit 130 with one line. ``cli.main`` puts Python's own handler back before
the command runs, so commands see KeyboardInterrupt as usual. A library user's process is left alone. A Ctrl-C
before pflkit's first import (Python's own start-up and its site packages: 0.1-0.3 s, longer on a loaded machine)
is Python's, which prints its own traceback: no code of the command has run yet.
"""
from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130


def is_fl_command() -> bool:
    """Whether this process is the ``fl`` command (not a process that imports pflkit or calls the command)."""
    if sys.argv and os.path.basename(sys.argv[0]) == "fl":  # its console script (a spawned child has "-c")
        return True
    argv = list(getattr(sys, "orig_argv", ()))  # python ... -m pflkit.core.cli (Python 3.10+)
    return any(a == "-m" and b == "pflkit.core.cli" for a, b in zip(argv, argv[1:]))


def _quiet_exit(signum, frame) -> None:
    # os._exit: nothing is written yet, and a SystemExit raised inside an import can be swallowed by library code
    # that catches BaseException (seen: the command then ran on)
    try:
        sys.stderr.write("interrupted during start-up; nothing was run\n")
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED)


def install() -> None:
    """Make a Ctrl-C during the fl command's imports exit 130 quietly (the main thread, the fl command only)."""
    try:
        if is_fl_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _quiet_exit)
    except (ValueError, OSError):  # not the main thread
        pass


def restore() -> None:
    """Python's own Ctrl-C handling (KeyboardInterrupt) from here on."""
    try:
        if signal.getsignal(signal.SIGINT) is _quiet_exit:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass


def forget_handled_interrupts() -> None:
    """Keep the command's own exit status after a Ctrl-C it handled. CPython notes a KeyboardInterrupt that leaves
    code run by ``exec`` of a string (the functions a dataclass or namedtuple builds while a module imports) as
    "unhandled" even when the command catches it further up; under ``python -m`` (and torchrun) the interpreter then
    ends by killing itself with SIGINT at exit, so ``sys.exit(130)`` or ``2`` came out as -2. Running one more
    string resets that note; a KeyboardInterrupt that truly leaves the command still sets it again."""
    exec("pass")  # noqa: S102  (a constant: the reset is the side effect of running any string)


install()
