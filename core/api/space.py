"""Search ranges of options, for ``fl tune``: declared where the option is declared (``Param(..., space=...)``).

A range is a float or integer interval (linear or logarithmic) or a list of choices. ``fl show NAME`` prints each
option's range; ``fl tune --space KEY=SPEC`` replaces one (or adds a range to an option that declares none, or
``KEY=off`` keeps a declared one fixed). SPEC is ``float:LOW..HIGH``, ``log:LOW..HIGH`` (a float on a log scale),
``int:LOW..HIGH``, ``intlog:LOW..HIGH`` or ``choice:A,B,C``. A trial draws each value through Optuna's
``trial.suggest_*`` (core/results/tuning.py); this module never imports Optuna.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from ..common.errors import ConfigError

KINDS = ("float", "log", "int", "intlog", "choice")
OFF = "off"  # --space KEY=off: the option stays at its configured value


@dataclass(frozen=True)
class Space:
    """One option's search range. Build it with :meth:`real`, :meth:`integer` or :meth:`choice`; ``source`` says
    where the range comes from (e.g. the paper's grid), shown by ``fl show``."""

    kind: str  # float | int | choice
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    choices: Optional[Tuple[Any, ...]] = None
    source: str = ""

    @classmethod
    def real(cls, low: float, high: float, log: bool = False, source: str = "") -> "Space":
        """Floats from ``low`` to ``high`` (on a log scale with ``log``)."""
        return cls._checked("float", low, high, log, None, source)

    @classmethod
    def integer(cls, low: int, high: int, log: bool = False, source: str = "") -> "Space":
        """Integers from ``low`` to ``high`` inclusive."""
        return cls._checked("int", low, high, log, None, source)

    @classmethod
    def choice(cls, values: Sequence[Any], source: str = "") -> "Space":
        """One of ``values`` (numbers, strings or booleans)."""
        return cls._checked("choice", None, None, False, tuple(values), source)

    @classmethod
    def _checked(cls, kind: str, low: Any, high: Any, log: bool, choices: Optional[Tuple[Any, ...]],
                 source: str) -> "Space":
        problem = _range_problem(kind, low, high, log, choices)
        if problem:
            raise ValueError(f"search range: {problem}")
        return cls(kind, low, high, bool(log), choices, source)

    def describe(self) -> str:
        """The range as ``--space`` text (``log:0.001..0.5``), with its source when it has one."""
        return self.text() + (f" ({self.source})" if self.source else "")

    def text(self) -> str:
        """The range as ``--space`` text: ``log:0.001..0.5``, ``int:1..5``, ``choice:0.01,0.1``."""
        if self.kind == "choice":
            return "choice:" + ",".join(_shown(v) for v in self.choices or ())
        prefix = {("float", False): "float", ("float", True): "log", ("int", False): "int",
                  ("int", True): "intlog"}[(self.kind, self.log)]
        return f"{prefix}:{_shown(self.low)}..{_shown(self.high)}"

    def suggest(self, trial: Any, key: str) -> Any:
        """The value an Optuna trial draws for option ``key`` from this range."""
        if self.kind == "float":
            return trial.suggest_float(key, float(self.low), float(self.high), log=self.log)
        if self.kind == "int":
            return trial.suggest_int(key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_categorical(key, list(self.choices or ()))

    def values_to_check(self) -> Tuple[Any, ...]:
        """The values the option itself must accept: both bounds, or every choice."""
        return tuple(self.choices or ()) if self.kind == "choice" else (self.low, self.high)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _range_problem(kind: str, low: Any, high: Any, log: bool, choices: Optional[Tuple[Any, ...]]) -> Optional[str]:
    if kind == "choice":
        if not choices:
            return "a choice needs at least one value"
        if not all(isinstance(v, (str, bool, int, float)) and (not isinstance(v, float) or math.isfinite(v))
                   for v in choices):
            return "choices must be numbers, strings or booleans"
        if len(set(map(repr, choices))) != len(choices):
            return "a choice lists a value twice"
        return None
    if not (_is_number(low) and _is_number(high)):
        return f"bounds must be finite numbers, got {low!r} and {high!r}"
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        return f"an integer range needs integer bounds, got {low!r} and {high!r}"
    if not low < high:
        return f"the range {low!r}..{high!r} is empty (LOW must be below HIGH)"
    if log and low <= 0:
        return f"a log range needs LOW > 0, got {low!r}"
    return None


def _shown(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def parse_space(key: str, text: str) -> Optional[Space]:
    """``--space KEY=SPEC``'s range (None for ``off``); a bad SPEC is one ConfigError naming ``key`` and why."""
    from .params import parse_value

    spec = text.strip()
    if spec.lower() == OFF:
        return None
    kind, sep, body = spec.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in KINDS:
        raise ConfigError(f"--space {key}={text}: expected one of {', '.join(k + ':...' for k in KINDS)} or off, "
                          f"e.g. log:0.001..0.5, int:1..5, choice:0.01,0.1,1")
    try:
        if kind == "choice":
            values = tuple(parse_value(v.strip()) for v in body.split(","))
            if any(v == "" for v in values):
                raise ValueError("an empty choice")
            return Space.choice(values)
        low_text, dots, high_text = body.partition("..")
        if not dots:
            raise ValueError(f"expected LOW..HIGH after '{kind}:'")
        low, high = parse_value(low_text.strip()), parse_value(high_text.strip())
        if kind in ("int", "intlog"):
            return Space.integer(low, high, log=kind == "intlog")
        return Space.real(low, high, log=kind == "log")
    except ValueError as exc:
        raise ConfigError(f"--space {key}={text}: {str(exc).removeprefix('search range: ')}") from None


def space_problem(key: str, space: Space, param: Any) -> Optional[str]:
    """Why option ``key`` (declared by ``param``) cannot take values from ``space``, or None: a numeric range on an
    option that is not a number, or a bound or choice the option itself refuses."""
    expected = param.value_type() if hasattr(param, "value_type") else None
    if space.kind in ("float", "int") and expected is not None and expected not in (int, float):
        return f"{key} takes a {expected.__name__}, not a number: give it choice:... instead of a numeric range"
    if space.kind == "float" and expected is int:
        return f"{key} takes integers: give it int:LOW..HIGH"
    for value in space.values_to_check():
        try:
            param.validate(key, int(value) if expected is int and _is_number(value) else value)
        except ConfigError as exc:
            return f"the range {space.text()} holds a value the option refuses: {exc}"
    return None
