"""A table's ``[[chosen]]`` entries must say only true things (``fl reproduce --check``).

An entry whose ``setting`` names configuration keys (``partition.min_size``, or several separated by commas) is
checked against what the table's cells resolve to at the paper's scale: every value a cell takes for such a key
must be named in the entry's ``value`` text (numbers compared as numbers, so ``1e-5`` names ``1e-05``). An entry
that names a key no cell has, or says a value the table does not set, is a contradiction: one line naming the
table, the entry, and a cell with the value it really takes. Entries whose setting is prose (``test rows``) are
the reader's to judge.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterator, List, Tuple

from ..common.errors import ConfigError

KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", re.IGNORECASE)


def setting_keys(setting: str) -> List[str]:
    """The configuration keys an entry's ``setting`` names: comma-separated dotted keys, else none (prose)."""
    parts = [p.strip() for p in setting.split(",")]
    return parts if parts and all(KEY.match(p) for p in parts) else []


def _lookup(cfg: Any, key: str) -> Tuple[bool, Any]:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _numbers(text: str) -> List[float]:
    return [float(n) for n in NUMBER.findall(text)]


def names_value(text: str, value: Any) -> bool:
    """Whether ``text`` names ``value``: a number among its numbers, a string or a bool as a word, every item of a
    list. None (a key left unset: its default, which entries describe in words, "the run seed") always passes."""
    if isinstance(value, bool):
        return re.search(rf"\b{str(value).lower()}\b", text.lower()) is not None
    if value is None:
        return True
    if isinstance(value, (int, float)):
        return any(math.isclose(n, float(value), rel_tol=1e-9, abs_tol=0.0) for n in _numbers(text))
    if isinstance(value, (list, tuple)):
        return all(names_value(text, v) for v in value)
    return str(value) in text


def resolved_cells(table) -> Iterator[Tuple[str, str, Dict[str, Any]]]:
    """(row id, column id, resolved config) of every cell at the paper's scale."""
    for column in table.columns:
        for row in table.rows:
            yield row.id, column.id, table.cell_config(row.id, column.id)


def check_chosen(table) -> None:
    """ConfigError naming the first ``[[chosen]]`` entry that contradicts what ``table`` sets."""
    keyed = [(entry, setting_keys(entry["setting"])) for entry in table.chosen]
    keyed = [(entry, keys) for entry, keys in keyed if keys]
    if not keyed:
        return
    cells = list(resolved_cells(table))
    for entry, keys in keyed:
        for key in keys:
            found = [(row, col, value) for row, col, cfg in cells for has, value in [_lookup(cfg, key)] if has]
            if not found:
                raise ConfigError(f"table {table.name}: [[chosen]] setting {entry['setting']!r} names {key}, which no "
                                  f"cell of the table has (a typo, or an option of another algorithm)")
            for row, col, value in found:
                if not names_value(entry["value"], value):
                    raise ConfigError(f"table {table.name}: [[chosen]] setting {entry['setting']!r} says "
                                      f"{entry['value'][:80]!r}, but the table sets {key} = {value!r} (row {row}, "
                                      f"column {col}); make the entry say what the table runs")
