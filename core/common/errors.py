"""User-facing errors. The CLI prints their message and exits with status 2, never a traceback."""
from __future__ import annotations

import difflib
from typing import Iterable


class PflError(Exception):
    """Base class of every error caused by the user's input or environment (not by a bug)."""


class ConfigError(PflError):
    """A configuration key is unknown or its value is invalid."""


class UnknownNameError(PflError):
    """A dataset, model, algorithm, ... name that no registry knows."""


class PluginError(PflError):
    """A plugin failed to load, or two distributions claim the same name."""


class CheckpointError(PflError):
    """A checkpoint or run directory is missing, corrupt or unwritable."""


class DataError(PflError):
    """A dataset cannot be loaded (missing files, wrong format, impossible partition)."""


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """Return ' Did you mean 'x'?' when a close match exists, else ''."""
    close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def unknown_name(kind: str, name: str, options: Iterable[str]) -> UnknownNameError:
    opts = sorted(options)
    listing = ", ".join(opts) if opts else "(none installed)"
    return UnknownNameError(f"unknown {kind} '{name}'.{did_you_mean(name, opts)} Available: {listing}")
