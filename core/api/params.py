"""Declared hyperparameters: every configurable key has a default, a meaning and a validity rule."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

from ..common import strictjson
from ..common.errors import ConfigError
from ..common.threads import MAX_THREADS

if TYPE_CHECKING:
    from .space import Space


@dataclass(frozen=True)
class Param:
    """One configurable key.

    ``type`` is inferred from ``default`` when omitted; ``check`` returns a reason string when a value is invalid;
    ``space`` (a :class:`~pflkit.core.api.space.Space`) is the range ``fl tune`` searches, where one makes sense.
    """

    default: Any
    help: str
    choices: Optional[Tuple[Any, ...]] = None
    check: Optional[Callable[[Any], Optional[str]]] = None
    type: Optional[type] = None
    nullable: bool = False
    space: Optional["Space"] = None  # the search range fl tune draws this option from (core/api/space.py)

    def value_type(self) -> Optional[type]:
        """The Python type a value of this option must have (``type``, else the default's type; None: any)."""
        if self.type is not None:
            return self.type
        if self.default is None:
            return None
        return type(self.default)

    def validate(self, key: str, value: Any) -> Any:
        """Coerce ``value`` to this parameter's type or raise a ConfigError naming ``key`` and the reason."""
        nullable = self.nullable or self.default is None
        if isinstance(value, str) and value.lower() == "none" and nullable and \
                not (self.choices and value in self.choices):
            value = None  # "--set key=none" on a nullable key means null; elsewhere "none" is just a string
        if value is None:
            if nullable:
                return None
            raise ConfigError(f"{key}: must not be null")
        expected = self.value_type()
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif expected is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif expected is tuple and isinstance(value, list):
            value = tuple(value)
        elif expected is list and isinstance(value, tuple):
            value = list(value)
        if expected in (int, float) and isinstance(value, str) and _non_finite_text(value) is not None:
            value = _non_finite_text(value)  # --set train.lr=inf: the finite-number message, not a type error
        elif expected is not None and not (isinstance(value, expected) and
                                           not (expected is int and isinstance(value, bool))):
            raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} {short_repr(value)}")
        bad = _first_non_finite(value)
        if bad is not None:
            raise ConfigError(f"{key}: {bad!r} is invalid: must be a finite number")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{key}: {short_repr(value)} is not one of {', '.join(map(repr, self.choices))}")
        if self.check is not None:
            reason = self.check(value)
            if reason:
                raise ConfigError(f"{key}: {short_repr(value)} is invalid: {reason}")
        return value


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message stays one readable line whatever was given
    (a 10 MB run_name)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _non_finite_text(text: str) -> Optional[float]:
    """``inf``, ``-Infinity``, ``nan`` ... as the float they name (JSON has no literal for them); else None."""
    if text.strip().lower().lstrip("+-") not in ("inf", "infinity", "nan"):
        return None
    return float(text)


def _first_non_finite(value: Any) -> Optional[float]:
    """NaN or +-Infinity anywhere in a value (JSON's ``Infinity`` parses to a float): never a valid setting."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            bad = _first_non_finite(v)
            if bad is not None:
                return bad
    if isinstance(value, dict):
        for v in value.values():
            bad = _first_non_finite(v)
            if bad is not None:
                return bad
    return None


# Reusable checks -----------------------------------------------------------------------------------------
def positive(v: Any) -> Optional[str]:
    """A ``Param`` check: None when ``v > 0``, else the reason."""
    return None if v > 0 else "must be > 0"


def non_negative(v: Any) -> Optional[str]:
    """A ``Param`` check: None when ``v >= 0``, else the reason."""
    return None if v >= 0 else "must be >= 0"


def unit_interval(v: Any) -> Optional[str]:
    """A ``Param`` check: None when ``0 <= v <= 1``, else the reason."""
    return None if 0 <= v <= 1 else "must lie in [0, 1]"


def open_unit_interval(v: Any) -> Optional[str]:
    """A ``Param`` check: None when ``0 < v <= 1``, else the reason."""
    return None if 0 < v <= 1 else "must lie in (0, 1]"


def ratio_range(v: Sequence[float]) -> Optional[str]:
    if len(v) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return "must be a pair of numbers [low, high]"
    lo, hi = v
    if not (0 < lo <= hi <= 1):
        return "needs 0 < low <= high <= 1"
    return None


def thread_count(v: Any) -> Optional[str]:
    return None if 0 < v <= MAX_THREADS else f"must lie in [1, {MAX_THREADS}]"


SEED_LIMIT = 2 ** 63


def seed_range(v: Any) -> Optional[str]:
    return None if 0 <= v < SEED_LIMIT else "must lie in [0, 2**63)"


NAME_BYTES = 255  # the longest file name most filesystems allow (NAME_MAX)


def plain_name(v: Any) -> Optional[str]:
    """A single path component: no separators, not '.', '..' or absolute (run directories stay in output_dir);
    printable UTF-8 of at most NAME_BYTES bytes (a newline or a control character in a folder name breaks every
    listing and log line that shows it)."""
    text = str(v)
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text or text.startswith("~"):
        return "must be a plain folder name (no '/', '\\', '..', '~', not absolute)"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # undecodable bytes from the command line (surrogate escapes)
        return "must be UTF-8 text (the name holds bytes that are not)"
    if size > NAME_BYTES:
        return f"must be at most {NAME_BYTES} bytes long (it has {size})"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text):
        return "must not contain a newline, tab or other control character"
    return None


def parse_value(text: str) -> Any:
    """Parse a ``--set`` value: JSON literals (numbers, true/false/null, lists, objects), else the raw string.

    ``none`` stays a string here (it can be a legitimate option value, e.g. ``aggregator.name=none``);
    ``Param.validate`` reads it as null for keys that accept null. JSON with a duplicate key or nested too deeply
    is a StrictJSONError (``strictjson``), not a string.
    """
    try:
        return strictjson.loads(text)
    except strictjson.StrictJSONError:
        raise
    except (json.JSONDecodeError, ValueError):
        low = text.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        return text


ParamSpec = Dict[str, Param]
