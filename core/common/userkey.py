"""This user's secret key (``verify.key`` in pflkit's state folder): what pflkit keys its digests of files it reuses
with -- a finished run's (``fl compare``'s ``verified.json``) and a shared set-up result (``core.api.artifacts``) --
so that a file edited, or copied in from another user or machine, is not trusted."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError


def verify_key() -> bytes:
    """This user's secret key for ``verified.json`` (created once, readable by the user alone): the state folder
    ``$PFLKIT_STATE`` (default ``$XDG_STATE_HOME/pflkit`` or ``~/.local/state/pflkit``), file ``verify.key``. A digest
    keyed with it cannot be recomputed by someone who edits a run's files without the key, as a plain sha256 can."""
    base = os.environ.get("PFLKIT_STATE") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "pflkit")
    path = Path(base) / "verify.key"
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(32).hex())
    except FileExistsError:
        pass  # another process made it meanwhile: read theirs
    except OSError as exc:
        raise CheckpointError(f"cannot create the key that verifies finished runs, {path} ({exc.strerror or exc}); "
                              f"set PFLKIT_STATE to a writable folder") from None
    return bytes.fromhex(path.read_text().strip())
