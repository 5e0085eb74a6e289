"""An algorithm = a named pairing of a client trainer and a server aggregator, with its paper's defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from .space import Space


@dataclass(frozen=True)
class Algorithm:
    """What ``fl run --plugin NAME`` selects.

    ``defaults`` is a partial config overlay (e.g. ``{"train": {"lr": 0.005}, "trainer": {"lambda_mmd": 5.0}}``)
    applied above the core defaults and below the user's file and ``--set`` values. ``searches`` sets ``fl tune``'s
    range of an option the algorithm does not declare itself (``{"train.lr": Space.real(...)}``), or ``None`` to keep
    one fixed that the algorithm does not use (L2GD steps with its own alpha, never ``train.lr``); ``--space``
    still outranks it.
    """

    trainer: str
    aggregator: str
    description: str = ""
    paper: str = ""
    defaults: Dict[str, Any] = field(default_factory=dict)
    searches: Dict[str, Optional["Space"]] = field(default_factory=dict)
