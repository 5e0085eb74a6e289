"""The committed index of the public API in docs/api.md: every name of ``pflkit.core.__all__`` and
``pflkit.core.testing.__all__`` with where it is defined and its docstring's first line.

The site expands the full reference below the index (docs/hooks/algorithms.py); the index is in the repository so
that a reader on GitHub, or offline, finds every public name. ``tests/test_api_docs.py`` fails when it is stale;
``python docs/hooks/api_index.py --write`` rewrites it.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import List

DOC = Path(__file__).resolve().parents[1] / "api.md"
BEGIN, END = "<!-- api-index -->", "<!-- /api-index -->"


def _summary(value) -> str:
    doc = inspect.getdoc(value) if (inspect.isclass(value) or callable(value)) else None
    if not doc:
        return {dict: "a constant (mapping)", list: "a constant (list)"}.get(type(value), type(value).__name__)
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|")


def _kind(value) -> str:
    if inspect.isclass(value):
        return "class"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return "function"
    return "object"


def _where(value, fallback: str) -> str:
    module = getattr(value, "__module__", None) if (inspect.isclass(value) or inspect.isfunction(value)) else None
    return module or fallback


def index_markdown() -> str:
    """The index block (between the markers) as it must read for the installed ``pflkit.core``."""
    from pflkit import core
    from pflkit.core import testing

    out: List[str] = [BEGIN, "", "### `pflkit.core`: what a plugin builds on", "",
                      "| name | kind | defined in | what it is |", "|---|---|---|---|"]
    for name in core.__all__:
        value = getattr(core, name)
        module = core._EXPORTS[name]
        module = "pflkit.core" + module if module.startswith(".") else module
        out.append(f"| `{name}` | {_kind(value)} | `{module}` | {_summary(value)} |")
    out += ["", "### `pflkit.core.testing`: helpers for a plugin's tests", "",
            "| name | kind | defined in | what it is |", "|---|---|---|---|"]
    for name in testing.__all__:
        value = getattr(testing, name)
        out.append(f"| `{name}` | {_kind(value)} | `{_where(value, 'pflkit.core.testing')}` | {_summary(value)} |")
    out += ["", END]
    return "\n".join(out)


def current_block(text: str) -> str:
    """The index block as committed in ``text`` (docs/api.md), markers included; '' when absent."""
    if BEGIN not in text or END not in text:
        return ""
    start = text.index(BEGIN)
    return text[start:text.index(END) + len(END)]


def write() -> None:
    text = DOC.read_text()
    block = current_block(text)
    if not block:
        raise SystemExit(f"{DOC} lacks the {BEGIN} ... {END} markers")
    DOC.write_text(text.replace(block, index_markdown()))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(index_markdown())
