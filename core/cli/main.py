"""The ``fl`` command line. Every user error is printed as one clear line (exit status 2), never a traceback."""
from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Tuple

import click

from ..errors import PflError


def friendly_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PflError as exc:
            raise click.ClickException(str(exc)) from None  # click prints "Error: ..." and exits 1
    return wrapper


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            exc.exit_code = 2
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging (client tracebacks).")
def cli(verbose: bool) -> None:
    """pflkit: personalized federated learning experiments with plugin algorithms."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def _register_commands() -> None:
    from .run import run_command
    from .listing import list_command, show_command
    from .scaffold import new_plugin_command
    from .partition import partition_command

    cli.add_command(run_command)
    cli.add_command(list_command)
    cli.add_command(show_command)
    cli.add_command(new_plugin_command)
    cli.add_command(partition_command)
    try:
        from .compare import compare_command
    except ImportError:  # the compare command is optional while it is being built
        return
    cli.add_command(compare_command)


_register_commands()


def main() -> None:
    cli(prog_name="fl")


if __name__ == "__main__":  # pragma: no cover
    main()
