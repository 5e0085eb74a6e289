"""Atomic checkpoints: written to a temporary file, fsynced, then renamed over the old one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict

import torch

from .errors import CheckpointError

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def save_checkpoint(run_dir: Path, state: Dict[str, Any]) -> Path:
    run_dir = Path(run_dir)
    target = run_dir / CHECKPOINT_NAME
    state = {"format_version": FORMAT_VERSION, **state}
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load_checkpoint(run_dir: Path) -> Dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.exists():
        raise CheckpointError(f"no checkpoint in {run_dir}: the run stopped before its first checkpoint "
                              f"(start it again without --resume)")
    try:
        # our own file: it holds numpy RNG states, so full unpickling is needed
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete ({type(exc).__name__}: {exc}); "
                              f"delete the run directory or restore the file") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a pflkit checkpoint of format {FORMAT_VERSION}")
    return state
