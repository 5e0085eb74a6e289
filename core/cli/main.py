"""The ``fl`` command line. Every user error is printed as one clear line (exit status 2), never a traceback."""
from __future__ import annotations

import logging

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    from .compare import compare_command

    cli.add_command(compare_command)
    from .plot import plot_command
    from .export import export_command

    cli.add_command(plot_command)
    cli.add_command(export_command)
    from .data import data_command

    cli.add_command(data_command)
    from .reproduce import reproduce_command

    cli.add_command(reproduce_command)
    from .results import results_command

    cli.add_command(results_command)
    from .tune import tune_command

    cli.add_command(tune_command)


_register_commands()


def main() -> None:
    from ..cli_start import forget_handled_interrupts, restore
    from ..common.threads import apply_cli_default

    restore()  # Ctrl-C raises KeyboardInterrupt again, which each command handles (fl run: exit 130)
    apply_cli_default()  # one torch thread unless OMP_NUM_THREADS says otherwise (docs/performance.md, "Threads")
    try:
        _run_command()
    finally:  # also when a command ends by sys.exit(130) after catching a Ctrl-C
        forget_handled_interrupts()


def _run_command() -> None:
    from ..cli_start import INTERRUPTED

    try:
        # not standalone: click would turn a Ctrl-C that lands outside a command's own handling (while it parses
        # the options or imports the engine) into "Aborted!" and exit status 1; Ctrl-C is 130 everywhere
        code = cli.main(prog_name="fl", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted (Ctrl-C); the command stopped before it finished", err=True)
        code = INTERRUPTED
    except click.ClickException as error:  # what standalone mode prints: usage errors, exit status 2
        error.show()
        code = error.exit_code
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
