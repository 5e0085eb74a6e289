"""``fl export RUN_DIR... --csv FILE``: the metrics of several runs as one table."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Tuple

import click

from ..errors import ConfigError
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
    from ..rundata import load_runs, rounds_table, summary_table, write_csv

    runs = load_runs([Path(d) for d in run_dirs])
    rows = (summary_table if summary else rounds_table)(runs, keys)
    if csv_path == "-":
        write_csv(rows, sys.stdout)
        return
    try:
        with open(csv_path, "w", newline="") as f:
            columns = write_csv(rows, f)
    except OSError as exc:
        raise ConfigError(f"--csv {csv_path}: cannot write ({exc.strerror or exc})") from None
    click.echo(f"{csv_path}: {len(rows)} rows x {len(columns)} columns from {len(runs)} run(s)")
