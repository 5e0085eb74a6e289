"""An algorithm = a named pairing of a client trainer and a server aggregator, with its paper's defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


@dataclass(frozen=True)
class Algorithm:
    """What ``fl run --plugin NAME`` selects.

    ``defaults`` is a partial config overlay (e.g. ``{"train": {"lr": 0.005}, "trainer": {"lambda_mmd": 5.0}}``)
    applied above the core defaults and below the user's file and ``--set`` values.
    """

    trainer: str
    aggregator: str
    description: str = ""
    paper: str = ""
    defaults: Dict[str, Any] = field(default_factory=dict)
