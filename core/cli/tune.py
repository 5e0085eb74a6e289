"""``fl tune``: tune one algorithm's options on its clients' validation splits with Optuna (core/results/tuning.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Tuple

import click

from ..common.errors import ConfigError
from ..engine.config import load_file, parse_sets
from .common import friendly_errors

INTERRUPTED = 130


def _space_items(items: Tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--space {item!r}: expected KEY=SPEC, e.g. train.lr=log:0.001..0.5 (or KEY=off)")
        if key.strip() in out:
            raise ConfigError(f"--space {key.strip()}: given twice")
        out[key.strip()] = text
    return out


@click.command("tune")
@click.option("--plugin", "-p", "plugin", required=True, help="Algorithm plugin to tune (fl list algorithms).")
@click.option("--trials", type=int, required=True, metavar="N",
              help="The study's total number of trials (a rerun with a larger N adds the difference).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder of the study: study.db, trials/, best.toml, trials.csv, plots.")
@click.option("--config", "-c", "config_file", type=click.Path(dir_okay=False), help="TOML or JSON config file.")
@click.option("--set", "-s", "sets", multiple=True, metavar="KEY=VALUE", help="Fix one option for every trial.")
@click.option("--space", "spaces", multiple=True, metavar="KEY=SPEC",
              help="Search KEY over SPEC: float:LOW..HIGH, log:LOW..HIGH, int:LOW..HIGH, intlog:LOW..HIGH, "
                   "choice:A,B,C; KEY=off keeps a declared range fixed (fl show NAME lists the declared ones).")
@click.option("--jobs", type=int, default=1, show_default=True, metavar="J",
              help="Trials run at once, one process each (a batch of J is asked, run, then told).")
@click.option("--metric", default=None, help="Validation key of metrics.jsonl to optimise (default "
                                             "val_<metric>/uniform, e.g. val_accuracy/uniform).")
@click.option("--objective", type=click.Choice(["best", "final"]), default="best", show_default=True,
              help="best: the metric's best evaluation (the validation-selected round); final: the mean of the last "
                   "eval.final_k evaluations.")
@click.option("--pruner", type=click.Choice(["median", "none"]), default="median", show_default=True,
              help="median: stop a trial whose validation metric falls below the median of completed trials at "
                   "the same round.")
@click.option("--seed", "study_seed", type=int, default=0, show_default=True,
              help="Seed of the sampler (the runs' own seed is --set seed=...).")
@friendly_errors
def tune_command(plugin: str, trials: int, out_dir: str, config_file: Optional[str], sets: Tuple[str, ...],
                 spaces: Tuple[str, ...], jobs: int, metric: Optional[str], objective: str, pruner: str,
                 study_seed: int) -> None:
    """Tune an algorithm's options with Optuna on a validation split (docs/tuning.md)."""
    from ..results.tuning import TuneRequest, tune

    layers = [load_file(config_file)] if config_file else []
    layers.append(parse_sets(sets))
    req = TuneRequest(plugin=plugin, layers=layers, trials=trials, out_dir=Path(out_dir), jobs=jobs,
                      spaces=_space_items(spaces), metric=metric, objective=objective, pruner=pruner,
                      seed=study_seed)
    try:
        result = tune(req, echo=click.echo)
    except KeyboardInterrupt:  # between two trials, or while a study is opened: nothing half-made, 130 as fl run
        click.echo(f"interrupted; rerun the same command to continue the study in {out_dir}", err=True)
        sys.exit(INTERRUPTED)
    if "best_trial" in result:
        params = ", ".join(f"{k}={v!r}" for k, v in result["best_params"].items())
        click.echo(f"best: trial {result['best_trial']}, {result['metric']} {result['best_value']:.4f} ({params})")
        click.echo(f"  run it: fl run --config {Path(out_dir) / 'best.toml'}")
    else:
        click.echo("no trial completed yet: no best options")
    click.echo(f"{result['trials']} trials ({result['complete']} complete, {result['pruned']} pruned, "
               f"{result['failed']} failed); files in {out_dir}: {', '.join(result['files'])}")
    if result.get("interrupted"):
        sys.exit(INTERRUPTED)
