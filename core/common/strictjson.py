"""JSON from files and command lines that pflkit did not write itself (configs, run files, partitions, ``--set``
values): parsed as data, strictly.

- A key given twice in one object is refused (``json`` would silently keep the last one, so a hand-edited file
  could say two things at once); the message names the key.
- Nesting deeper than ``MAX_DEPTH`` levels is refused before any recursive code walks it (pflkit's own files are at
  most 4 levels deep; the parser itself would otherwise end in a RecursionError).

Both are ``StrictJSONError``, a ``ValueError``, so every caller that already turns a ``json.JSONDecodeError`` into
one clear line handles them too.
"""
from __future__ import annotations

import json
from typing import Any, List, Tuple

MAX_DEPTH = 32


class StrictJSONError(ValueError):
    """Input that is valid JSON to ``json.loads`` but refused here (a duplicate key, too deep), or too deep to
    parse at all."""


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise StrictJSONError(f"duplicate key {_short(key)!r} in one object")
        out[key] = value
    return out


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse containers nested deeper than ``limit`` (iterative: no recursion of its own)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise StrictJSONError(f"nested more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses duplicate keys and deep nesting (StrictJSONError, a ValueError)."""
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise StrictJSONError(f"nested more than {MAX_DEPTH} levels deep") from None
    check_depth(value)
    return value
