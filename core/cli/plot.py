"""``fl plot RUN_DIR...``: redraw accuracy and loss curves from existing run directories."""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import click

from .common import friendly_errors


@click.command("plot")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--out", "-o", "out", default="curves.png", show_default=True, type=click.Path(dir_okay=False),
              help="Image to write; the format follows the extension (png, pdf, svg).")
@click.option("--band", type=click.Choice(["p10-p90", "min-max", "std", "none"]), default="p10-p90",
              show_default=True, help="Across-client spread drawn around each run's uniform curve.")
@click.option("--group", type=click.Choice(["run", "algorithm"]), default="run", show_default=True,
              help="run: every run its own curves. algorithm: one colour per algorithm (config.json's algorithm), "
                   "the mean over its runs (seeds) with a std band, uniform and weighted side by side -- the figure "
                   "fl compare draws.")
@friendly_errors
def plot_command(run_dirs: Tuple[str, ...], out: str, band: str, group: str) -> None:
    """Redraw metric and loss curves of existing run directories.

    Per run: the test metric per evaluated round, uniform and weighted, with the across-client spread as a band,
    and the train and test loss; nothing is rerun. With --group algorithm: per algorithm the mean over its runs
    with a std band over them (--band does not apply). Accuracy axes are in percent."""
    from ..storage.rundata import load_runs
    from ..results.runplot import plot_groups, plot_runs

    runs = load_runs([Path(d) for d in run_dirs])
    if group == "algorithm":
        drawn = plot_groups(runs, Path(out), group="algorithm")
        click.echo(f"{out}: {drawn} algorithm(s) from {len(runs)} run(s), mean {runs[0].metric} per round "
                   f"(band: std over runs)")
    else:
        drawn = plot_runs(runs, Path(out), band=band)
        click.echo(f"{out}: {drawn} run(s), {runs[0].metric} and loss per round")
        algorithms = {r.config.get("algorithm") for r in runs if isinstance(r.config.get("algorithm"), str)}
        if len(algorithms) < len(runs) and len(runs) > 2:  # e.g. the seeds of a comparison: one colour each
            click.echo(f"note: {len(runs)} runs of {len(algorithms)} algorithm(s); --group algorithm draws one "
                       f"colour per algorithm, the mean over its runs with a std band")
    for run in runs:
        if run.status != "finished":
            click.echo(f"note: {run.label} is not finished ({run.status}, {run.records[-1]['round']} rounds logged)")
