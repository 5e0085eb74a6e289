"""Shared CLI plumbing."""
from __future__ import annotations

import functools
from typing import Any, Callable

import click

from ..common.errors import PflError


def friendly_errors(fn: Callable) -> Callable:
    """Turn user errors into one 'Error: ...' line (exit status 2) instead of a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PflError as exc:
            raise _UserError(str(exc)) from None
    return wrapper


class _UserError(click.ClickException):
    exit_code = 2
