"""``fl reproduce``: run a paper's table (published by a plugin as data) and set pflkit's numbers beside the paper's."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import click

from ..api import registry as reg
from ..common.errors import ConfigError, PflError
from .common import friendly_errors
from ..results.labels import NEUTRAL_SET_KEYS
from .compare import _names, _seeds, echo_submission, launcher_options, launcher_settings


def _tables(table_file: Optional[str]) -> Tuple[List, Dict[str, str]]:
    """The tables that load and parse, and name -> why for those that do not: one broken third-party table names
    itself and blocks no other."""
    from ..results.tables import installed_table, parse_table, read_table_file

    if table_file:
        name, source = read_table_file(table_file)
        return [parse_table(name, source)], {}
    broken = {f.name: str(f) for f in reg.TABLES.load_all()}
    tables = []
    for name in reg.TABLES.names():
        if name in broken:
            continue
        try:
            tables.append(installed_table(name))
        except PflError as exc:
            broken[name] = str(exc)
    return tables, broken


@click.command("reproduce")
@click.argument("table", required=False)
@click.option("--list", "do_list", is_flag=True, help="List every table, its columns' datasets and whether their "
                                                        "data are present.")
@click.option("--check", "do_check", is_flag=True, help="Validate every table offline (schema, known algorithms, "
                                                          "valid options and configs, numbers present).")
@click.option("--table-file", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Use this table file instead of the installed tables (e.g. one you are writing).")
@click.option("--rows", default=None, metavar="A,B", help="Only these rows (method ids).")
@click.option("--cols", default=None, metavar="X,Y", help="Only these columns.")
@click.option("--seeds", default="0,1,2", show_default=True, metavar="S1,S2,...", help="Seeds of every cell.")
@click.option("--scale", default="paper", show_default=True, type=click.Choice(["paper", "quick"]),
              help="paper: the table's settings; quick: fewer rounds and a fraction of the data (labelled in every "
                   "output file and section: not the paper's setting).")
@click.option("--out", "-o", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Output folder (default: reproduce-<table>-<scale>): results.md, results.csv and one fl compare "
                   "folder per column (resumable).")
@click.option("--jobs", "-j", default=1, show_default=True, type=click.IntRange(min=1), help="Runs at a time.")
@click.option("--runs-per-device", default=None, type=int, metavar="K",
              help="With --jobs on CUDA GPUs: each worker pinned to one visible GPU, at most K per GPU (default 1).")
@launcher_options
@click.option("--set", "-s", "sets", multiple=True, metavar="KEY=VALUE",
              help=f"Override a config key in every cell (rounds=50, device=cuda). Repeatable. Keys that say where or "
                   f"how a cell runs ({', '.join(NEUTRAL_SET_KEYS)}) keep the paper's setting; any other is labelled "
                   f"in every output file and section: not the paper's setting.")
@click.option("--tune", "tune_trials", type=int, default=None, metavar="N",
              help="First tune every row of each column with N trials of fl tune on a validation split, then report "
                   "pflkit tuned (the test metric at the validation-selected round) beside the paper and pflkit at "
                   "the paper's options; runs in OUT/<column>-tune (docs/tuning.md).")
@friendly_errors
def reproduce_command(table: Optional[str], do_list: bool, do_check: bool, table_file: Optional[str],
                      rows: Optional[str], cols: Optional[str], seeds: str, scale: str, out_dir: Optional[str],
                      jobs: int, runs_per_device: Optional[int], launcher: Optional[str],
                      launcher_config: Optional[str], slurm_partition: Optional[str], slurm_time: int,
                      slurm_gpus: int, slurm_cpus: int,
                      slurm_mem_gb: Optional[float], slurm_account: Optional[str], slurm_array_parallelism: int,
                      slurm_options: Tuple[str, ...], sets: tuple, tune_trials: Optional[int]) -> None:
    """Run TABLE (fl reproduce --list) and write the paper's numbers beside pflkit's.

    Every cell runs through fl compare (one comparison per column, finished runs reused). results.md and results.csv
    hold per cell the paper's number, pflkit's mean ± std over seeds, the difference and whether pflkit's mean lies
    within the paper's spread, and the rows ranked both ways. Missing data are named, with the fl data install
    command or the files to place, before anything runs (exit 2). Then one line estimates the run time (with
    --jobs), from the first rounds of one run per row and setting: those runs pause with a checkpoint and continue.
    """
    from ..results.reproduce import list_lines, reproduce, scale_label
    from ..results.tables import check_table

    if do_list or do_check:
        if table is not None:
            raise ConfigError("--list and --check cover every table; leave out TABLE")
        tables, broken = _tables(table_file)
        if do_list:
            for line in list_lines(tables):
                click.echo(line)
        failed = dict(broken)
        if do_check:
            for t in tables:
                try:
                    cells = check_table(t)
                except PflError as exc:
                    if table_file:  # the one table being written: its error is the one line
                        raise
                    failed[t.name] = str(exc)
                    continue
                click.echo(f"{t.name}: ok ({len(t.rows)} rows x {len(t.columns)} columns, {cells} cells resolved)")
        for name, why in failed.items():
            click.echo(f"{name}: BROKEN: {why}", err=True)
        if failed and do_check:
            raise ConfigError(f"{len(failed)} table(s) broken: {', '.join(failed)}")
        return
    tables, broken = _tables(table_file)
    if table in broken:
        raise ConfigError(broken[table])
    if table is None:
        if not table_file:
            raise ConfigError(f"name a table ({', '.join(t.name for t in tables) or 'none installed'}), or use "
                              f"--list / --check")
        chosen = tables[0]
    else:
        from ..results.tables import installed_table

        chosen = tables[0] if table_file else installed_table(table)
    check_table(chosen)
    out = Path(out_dir or f"reproduce-{chosen.name.replace(':', '-')}-{scale}")
    settings = launcher_settings(launcher_config, launcher, slurm_partition, slurm_time, slurm_gpus, slurm_cpus,
                                 slurm_mem_gb, slurm_account, slurm_array_parallelism, slurm_options)
    try:
        report = reproduce(chosen, out, rows=_names(rows, "rows") if rows else None,
                           cols=_names(cols, "cols") if cols else None, seeds=_seeds(seeds), scale=scale, jobs=jobs,
                           echo=click.echo, sets=list(sets), runs_per_device=runs_per_device, launcher=settings,
                           tune_trials=tune_trials)
    except KeyboardInterrupt:  # between two runs, or a column's runs stopped: as fl compare, 130 and how to go on
        click.echo(f"interrupted; rerun the same command to continue (finished runs are reused, interrupted ones "
                   f"resume from their checkpoints): {out}", err=True)
        raise SystemExit(130) from None
    if settings is not None and (report["submitted"] or report["waiting"]):
        echo_submission(report, f"{out}/<column>/jobs/")
        return
    click.echo(report["markdown"])
    label = scale_label(scale == "quick", list(sets))
    tag = f"[{label}] " if label else ""
    click.echo(f"{tag}table: {report['files']['markdown']}  (csv: {report['files']['csv']})")
    if report["incomplete"]:
        click.echo(f"{tag}{report['incomplete']} run(s) failed or are incomplete; rerun the same command to "
                   f"continue (finished runs are reused)", err=True)
        raise SystemExit(1)
