"""``fl export RUN_DIR... --csv FILE``: the metrics of several runs as one table."""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Tuple

import click

from ..common.errors import ConfigError
from .common import friendly_errors


@click.command("export")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--csv", "csv_path", required=True, metavar="FILE",
              help="CSV file to write ('-' for standard output).")
@click.option("--summary", is_flag=True,
              help="One row per run (status, final and best numbers) instead of one row per round.")
@click.option("--key", "-k", "keys", multiple=True, metavar="KEY",
              help="Add a config value as a column, e.g. --key train.lr --key partition.alpha (repeatable).")
@friendly_errors
def export_command(run_dirs: Tuple[str, ...], csv_path: str, summary: bool, keys: Tuple[str, ...]) -> None:
    """Write the metrics of several run directories as one CSV table.

    A row per run and round (identified by run, algorithm, dataset and seed, then every per-round field), or with
    --summary a row per run (status, final and best numbers)."""
    from ..storage.rundata import load_runs, rounds_table, summary_table, write_csv, write_output

    runs = load_runs([Path(d) for d in run_dirs])
    rows = (summary_table if summary else rounds_table)(runs, keys)
    buf = io.StringIO()
    columns = write_csv(rows, buf)
    if csv_path == "-":
        _to_stdout(buf.getvalue())
        return
    write_output(Path(csv_path), buf.getvalue().encode("utf-8"), "--csv")
    click.echo(f"{csv_path}: {len(rows)} rows x {len(columns)} columns from {len(runs)} run(s)")


def _to_stdout(text: str) -> None:
    """Write the table to standard output; a closed stdout or a reader that went away (``| head``) is one line on
    stderr, exit status 2."""
    if sys.stdout is None:  # started with descriptor 1 closed
        raise ConfigError("--csv -: cannot write to standard output (it is closed)")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError) as exc:  # EPIPE / EBADF, or "I/O operation on closed file"
        try:  # nothing more reaches stdout: keep Python's exit-time flush from printing a second error
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "it is closed"
        raise ConfigError(f"--csv -: cannot write to standard output ({why})") from None
