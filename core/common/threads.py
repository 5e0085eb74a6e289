"""Torch CPU threads of a run: the ``threads`` setting, and the ``fl`` command's default.

Results depend on the thread count (CPU kernels sum in another order), so a run applies its setting for its own
duration and records what it used. ``threads = null`` keeps the process's setting, which the ``fl`` command makes
``CLI_DEFAULT_THREADS`` unless ``OMP_NUM_THREADS`` is set: on a shared 2-core machine one thread was as fast as two
when idle and several times faster under load (docs/performance.md, "Threads").
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Mapping, Optional

CLI_DEFAULT_THREADS = 1
MAX_THREADS = 1024  # the most threads the ``threads`` setting (core.api.params) and OMP_NUM_THREADS may ask for
_cli_default_applied = False  # whether this process's thread count is the fl command's default


def env_threads_problem(text: str) -> Optional[str]:
    """Why OMP_NUM_THREADS=``text`` is refused (None: it is a thread count, or OpenMP's list of them per nesting
    level, each from 1 to ``MAX_THREADS``, the limit of the ``threads`` setting)."""
    parts = [p.strip() for p in text.split(",")]
    if all(p.isascii() and p.isdigit() and len(p) <= 6 and 1 <= int(p) <= MAX_THREADS for p in parts):
        return None
    return (f"OMP_NUM_THREADS={text[:40]!r}: expected a number of threads from 1 to {MAX_THREADS} (or unset it: "
            f"the fl command then uses {CLI_DEFAULT_THREADS})")


def apply_cli_default() -> None:
    """Called by the ``fl`` entry point before any work: 1 torch thread unless the user set OMP_NUM_THREADS
    (which must then be a thread count: anything else ends the command with one line, exit status 2).

    The environment variable also reaches worker processes (``fl compare --jobs``) and BLAS libraries.
    """
    global _cli_default_applied
    text = os.environ.get("OMP_NUM_THREADS")
    if text:
        problem = env_threads_problem(text)
        if problem is not None:
            sys.stderr.write(f"Error: {problem}\n")
            raise SystemExit(2)
        return
    os.environ["OMP_NUM_THREADS"] = str(CLI_DEFAULT_THREADS)
    _cli_default_applied = True
    torch = sys.modules.get("torch")
    if torch is not None:  # already imported: it read the environment before we set it
        torch.set_num_threads(CLI_DEFAULT_THREADS)


def effective_threads(cfg: Mapping[str, Any]) -> int:
    """The torch thread count a run of ``cfg`` uses: its ``threads`` setting, else the process's current one."""
    import torch

    n = cfg.get("threads")
    return int(n) if n is not None else torch.get_num_threads()


def threads_source(cfg: Mapping[str, Any]) -> str:
    """Where a run's thread count comes from (recorded in run_info.json)."""
    if cfg.get("threads") is not None:
        return "threads setting"
    if _cli_default_applied:
        return f"fl default ({CLI_DEFAULT_THREADS}; OMP_NUM_THREADS unset)"
    if os.environ.get("OMP_NUM_THREADS"):
        return "OMP_NUM_THREADS"
    return "process setting (torch.set_num_threads or torch's default)"


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Use ``n`` torch threads inside the block (None: leave the setting alone), restoring the previous count."""
    import torch

    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
