"""Checkpoints as data, never code: a checksummed header, then a ``torch.save`` body read with ``weights_only``.

File layout (format 2)::

    PFLKIT-CHECKPOINT\\n
    {"format_version": 2, "body_sha256": ..., "body_bytes": ..., "config_sha256": ..., ...}\\n   (one JSON line)
    <torch.save bytes of the state>

The body's checksum is verified before anything is unpickled, and the body is unpickled with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers: a crafted file cannot run
code. Types that ``weights_only`` does not know (numpy arrays and scalars in RNG states) are converted to tensors
and plain values on the way out and back on the way in. Writes are atomic: a temporary file in the run directory,
fsynced, then renamed over the previous checkpoint, which therefore stays intact when a write fails.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import torch

from .errors import CheckpointError

CHECKPOINT_NAME = "checkpoint.pt"
TEMP_PREFIX = ".checkpoint-"
TEMP_SUFFIX = ".tmp"
FORMAT_VERSION = 2
MAGIC = b"PFLKIT-CHECKPOINT\n"
_MAX_HEADER = 1 << 16
_NDARRAY_TAG = "__pflkit_ndarray__"


def to_safe(obj: Any) -> Any:
    """Convert what ``weights_only`` loading cannot rebuild into tensors and plain values (see ``from_safe``)."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY_TAG: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, to_safe(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: to_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_safe(v) for v in obj)
    return obj


def from_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _NDARRAY_TAG in obj:
            return obj[_NDARRAY_TAG].numpy()
        return type(obj)((k, from_safe(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: from_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_safe(v) for v in obj)
    return obj


def remove_orphaned_temporaries(run_dir: Path) -> int:
    """Delete temporary checkpoint files left by a write that was killed; returns how many."""
    n = 0
    for p in Path(run_dir).glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def save_checkpoint(run_dir: Path, state: Dict[str, Any], meta: Dict[str, Any]) -> Path:
    """Write ``state`` atomically; ``meta`` (JSON-able: config hash, algorithm, round, ...) goes into the header."""
    run_dir = Path(run_dir)
    target = run_dir / CHECKPOINT_NAME
    buf = io.BytesIO()
    torch.save(to_safe(state), buf)
    body = buf.getvalue()
    header = {"format_version": FORMAT_VERSION, "body_sha256": hashlib.sha256(body).hexdigest(),
              "body_bytes": len(body), **meta}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=run_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        _discard(tmp)
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; the previous checkpoint "
                              f"is intact (free space or fix permissions, then 'fl run --resume {run_dir}')") from exc
    except BaseException:
        _discard(tmp)
        raise
    return target


def _discard(tmp: str | None) -> None:
    if tmp and os.path.exists(tmp):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def read_header(path: Path) -> Tuple[Dict[str, Any], bytes]:
    """Header and verified body bytes of a checkpoint file; a damaged or foreign file is a CheckpointError."""
    restore = "restore the file from a copy, or start the run again"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if not raw.startswith(MAGIC):
        if raw[:2] == b"PK":
            raise CheckpointError(f"checkpoint {path} was written by an older pflkit (format 1), which cannot be "
                                  f"loaded safely; start the run again")
        raise CheckpointError(f"{path} is not a pflkit checkpoint (corrupt or foreign file); {restore}")
    end = raw.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_HEADER)
    try:
        if end < 0:
            raise ValueError("no header line")
        header = json.loads(raw[len(MAGIC):end].decode())
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt (unreadable header: {exc}); {restore}") from exc
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {header.get('format_version')!r}; this pflkit reads "
                              f"format {FORMAT_VERSION}")
    body = raw[end + 1:]
    if len(body) != header.get("body_bytes") or hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete (checksum mismatch: the file was damaged "
                              f"or edited); {restore}")
    return header, body


def load_checkpoint(run_dir: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(header, state) of the run's checkpoint. The state is rebuilt as data only (``weights_only=True``)."""
    path = Path(run_dir) / CHECKPOINT_NAME
    header, body = read_header(path)
    try:
        state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} holds data that is not plain tensors and containers; refused "
                              f"({first[:200]})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a pflkit run state")
    return header, from_safe(state)


def checkpoint_exists(run_dir: Path) -> bool:
    return (Path(run_dir) / CHECKPOINT_NAME).is_file()
