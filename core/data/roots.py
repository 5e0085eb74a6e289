"""Where data sets live (``dataset.root``): the rule and its folder, with no heavy import, so the ``fl`` command's
start and ``fl data`` need neither torch nor numpy for it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


#: the rule for ``dataset.root`` when it is not set, in words (config's description, every loader's message, fl data)
ROOT_RULE = "$PFLKIT_DATA if not empty, else ./data"


def dataset_root(root: Optional[str] = None) -> Path:
    """The folder every dataset loader reads and ``fl data install`` writes: ``dataset.root`` when given, else
    ``$PFLKIT_DATA`` when set and not empty (an empty value is unset: it would mean the current folder by accident),
    else ``./data``. A relative folder is relative to the current folder, as the user typed it."""
    if root is None or str(root) == "":
        root = os.environ.get("PFLKIT_DATA") or "data"
    return Path(root).expanduser()


def root_words(root: Optional[str] = None) -> str:
    """``dataset.root`` as messages name it: the folder, and where it came from when the user did not set it."""
    folder = dataset_root(root)
    if root is not None and str(root) != "":
        return f"dataset.root '{folder}'"
    return f"dataset.root '{folder}' (unset: {ROOT_RULE})"
