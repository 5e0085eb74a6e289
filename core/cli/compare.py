"""``fl compare``: several algorithms on the same dataset, partition and seeds -> table + curves."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import click

from ..engine.config import load_file, parse_sets
from ..common.errors import ConfigError
from .common import friendly_errors


def _is_terminal() -> bool:
    try:
        return sys.stdout is not None and sys.stdout.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stdout
        return False


def _names(text: str, what: str) -> List[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--{what}: give a comma-separated list")
    return items


def _specs(text: str) -> List[str]:
    """``--plugins`` entries, split on commas outside brackets: a variant's value may be a list
    (``fedcp+participation.random_join_ratio=[0.1,1]``)."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    items = [t.strip() for t in items if t.strip()]
    if not items:
        raise ConfigError("--plugins: give a comma-separated list of algorithms or variants (NAME+key=value)")
    return items


def _seeds(text: str) -> List[int]:
    try:
        return [int(s) for s in _names(text, "seeds")]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None


def _split_sets(sets: Tuple[str, ...]) -> Tuple[List[str], Dict[str, List[str]]]:
    """``ALGO:key=value`` applies to one algorithm only; plain ``key=value`` to all."""
    common: List[str] = []
    per_algo: Dict[str, List[str]] = {}
    for item in sets:
        head, sep, rest = item.partition(":")
        if sep and "=" not in head and "." not in head:
            per_algo.setdefault(head.strip(), []).append(rest)
        else:
            common.append(item)
    return common, per_algo


LAUNCHER_OPTIONS = [
    click.option("--launcher", type=click.Choice(["slurm", "submitit-local"]), default=None,
                 help="Submit the runs still to do as a job array through submitit (slurm; submitit-local: the same jobs "
                       "as local processes) and return; run the same command again to collect (docs/scaling.md)."),
    click.option("--launcher-config", default=None, type=click.Path(dir_okay=False), metavar="FILE",
                 help="The launcher and its settings from the [launcher] table of a TOML file (name, partition, time, "
                      "gpus, cpus, mem_gb, account, array_parallelism, [launcher.options]); an option given on the "
                      "command line outranks the file."),
    click.option("--slurm-partition", default=None, help="--launcher slurm: the partition."),
    click.option("--slurm-time", default=60, show_default=True, type=int, metavar="MIN",
                 help="--launcher: each job's time limit in minutes (a run that hits it is requeued and resumes)."),
    click.option("--slurm-gpus", default=0, show_default=True, type=int, help="--launcher: GPUs per job."),
    click.option("--slurm-cpus", default=1, show_default=True, type=int, help="--launcher: CPUs per job."),
    click.option("--slurm-mem-gb", default=None, type=float, help="--launcher slurm: memory per job (GiB)."),
    click.option("--slurm-account", default=None, help="--launcher slurm: the account to charge."),
    click.option("--slurm-array-parallelism", default=256, show_default=True, type=int,
                 help="--launcher slurm: tasks of the job array running at once."),
    click.option("--slurm-option", "slurm_options", multiple=True, metavar="KEY=VALUE",
                 help="--launcher slurm: another sbatch option (qos=high, constraint=a100). Repeatable."),
]
# --launcher-config's [launcher] keys -> the command-line option each stands for
LAUNCHER_FILE_KEYS = {"name": "launcher", "partition": "slurm_partition", "time": "slurm_time", "gpus": "slurm_gpus",
                      "cpus": "slurm_cpus", "mem_gb": "slurm_mem_gb", "account": "slurm_account",
                      "array_parallelism": "slurm_array_parallelism", "options": "slurm_options"}
SLURM_PARAMS = ("slurm_partition", "slurm_time", "slurm_gpus", "slurm_cpus", "slurm_mem_gb", "slurm_account",
                "slurm_array_parallelism", "slurm_options")


def launcher_options(fn):
    """The --launcher, --launcher-config and --slurm-* options of fl compare and fl reproduce
    (core/results/launchers.py)."""
    for option in reversed(LAUNCHER_OPTIONS):
        fn = option(fn)
    return fn


def _launcher_file(path: str) -> Dict[str, object]:
    """--launcher-config FILE's [launcher] table as command-line values (data, never code; a wrong key or type is one
    line that names it)."""
    data = load_file(path)
    where = f"--launcher-config {path}"
    extra = sorted(set(data) - {"launcher"})
    if extra or not isinstance(data.get("launcher"), dict):
        raise ConfigError(f"{where}: expected one table [launcher]" + (f", not {', '.join(extra)}" if extra else ""))
    values: Dict[str, object] = {}
    for key, value in data["launcher"].items():
        if key not in LAUNCHER_FILE_KEYS:
            raise ConfigError(f"{where}: unknown key launcher.{key} (known: {', '.join(LAUNCHER_FILE_KEYS)})")
        if key == "name":
            if value not in ("slurm", "submitit-local"):
                raise ConfigError(f"{where}: launcher.name must be \"slurm\" or \"submitit-local\", got {value!r}")
        elif key in ("partition", "account"):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: launcher.{key} must be a non-empty string, got {value!r}")
        elif key == "mem_gb":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: launcher.mem_gb must be a number (GiB), got {value!r}")
            value = float(value)
        elif key == "options":
            if not isinstance(value, dict) or not all(
                    isinstance(v, (str, int)) and not isinstance(v, bool) for v in value.values()):
                raise ConfigError(f"{where}: launcher.options must be a table of sbatch options (qos = \"high\"), "
                                  f"got {value!r}")
            value = tuple(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, bool) or not isinstance(value, int):  # time, gpus, cpus, array_parallelism
            raise ConfigError(f"{where}: launcher.{key} must be an integer, got {value!r}")
        values[LAUNCHER_FILE_KEYS[key]] = value
    return values


def launcher_settings(launcher_config: Optional[str], launcher: Optional[str], partition: Optional[str],
                      time_min: int, gpus: int, cpus: int, mem_gb: Optional[float], account: Optional[str],
                      parallelism: int, options: Tuple[str, ...]) -> Optional[object]:
    """The ``--launcher`` settings (None without one): ``--launcher-config``'s values under the options given on the
    command line; an ``--slurm-*`` setting without a launcher is refused."""
    from ..results.launchers import LauncherSettings

    given = {"launcher": launcher, "slurm_partition": partition, "slurm_time": time_min, "slurm_gpus": gpus,
             "slurm_cpus": cpus, "slurm_mem_gb": mem_gb, "slurm_account": account,
             "slurm_array_parallelism": parallelism, "slurm_options": options}
    values = dict(given)
    explicit = set(given)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:  # what the user typed (or set in the environment), not click's defaults
        explicit = {name for name in given
                    if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)}
    from_file = set()
    if launcher_config:
        for name, value in _launcher_file(launcher_config).items():
            if name not in explicit:
                values[name] = value
                from_file.add(name)
    if values["launcher"] is None:
        flags = [f"--{name.replace('_', '-')}" if name != "slurm_options" else "--slurm-option"
                 for name in SLURM_PARAMS if name in explicit]
        keys = [key for key, name in LAUNCHER_FILE_KEYS.items() if name in from_file]
        if flags or keys:
            what = ", ".join(flags + [f"launcher.{key} (--launcher-config)" for key in keys])
            raise ConfigError(f"{what} need --launcher slurm (or submitit-local, or launcher.name in the file)")
        return None
    extra = {}
    for item in values["slurm_options"]:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--slurm-option {item!r}: expected KEY=VALUE (an sbatch option without its dashes)")
        extra[key.strip()] = value.strip()
    return LauncherSettings(values["launcher"], partition=values["slurm_partition"], time_min=values["slurm_time"],
                            gpus_per_job=values["slurm_gpus"], cpus_per_job=values["slurm_cpus"],
                            mem_gb=values["slurm_mem_gb"], account=values["slurm_account"],
                            array_parallelism=values["slurm_array_parallelism"], extra=extra)


def echo_submission(results: dict, outputs: str) -> None:
    """What a submitting command says: the job ids, how to watch (``outputs``: where each job's stdout/stderr are),
    how to collect."""
    if results["submitted"]:
        ids = ", ".join(results["submitted"])
        click.echo(f"submitted {len(results['submitted'])} run(s) as {results['launcher']} job(s): {ids}")
    if results["waiting"]:
        click.echo(f"{len(results['waiting'])} run(s) still queued or running from an earlier submission, left alone: "
                   f"{', '.join(results['waiting'])}")
    watch = "squeue --me" if results["launcher"] == "slurm" else "ps"
    click.echo(f"watch: {watch}; each job's output: {outputs}; collect: run the same command again (finished runs "
               f"are reused, failed or missing ones resubmitted, queued or running ones left alone)")


@click.command("compare")
@click.option("--plugins", "-p", "plugins", required=True, metavar="A,B+KEY=VALUE,...",
              help="Algorithms to compare, comma-separated (fl list algorithms). NAME+key=value[+key=value] is a "
                   "labelled variant: NAME with those settings, its own row (fedcac+aggregator.collaboration=local).")
@click.option("--seeds", default="0", show_default=True, metavar="S1,S2,...",
              help="Seeds; every algorithm runs once per seed (the seed fixes init and sampling, and the partition "
                   "unless partition.seed is set).")
@click.option("--config", "-c", "config_file", type=click.Path(dir_okay=False),
              help="TOML or JSON config file applied to every algorithm.")
@click.option("--set", "-s", "sets", multiple=True, metavar="[ALGO:]KEY=VALUE",
              help="Override a config key for every algorithm (train.lr=0.01), or for one (fedprox:trainer.mu=0.1). "
                   "Repeatable.")
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output folder: results.md, results.json, results.csv (the table as data, with the machine "
                   "and commit that computed it), curves.png and runs/<label>-seed<k>/.")
@click.option("--jobs", "-j", default=1, show_default=True, type=click.IntRange(min=1),
              help="Runs at a time, each in its own process. Every run uses one torch thread, also with --jobs 1, so "
                   "the numbers do not depend on --jobs.")
@click.option("--runs-per-device", default=None, type=int, metavar="K",
              help="With --jobs on CUDA GPUs (device cuda, or auto on a GPU machine): each worker is pinned to one "
                   "visible GPU, at most K per GPU (default 1); the placement is printed and recorded in each run's "
                   "run_info.json.")
@launcher_options
@click.option("--progress/--no-progress", default=True,
              help="Draw a progress bar per run (only with --jobs 1 and when standard output is a terminal; "
                   "otherwise one line per run as it ends).")
@click.option("--tune", "tune_trials", type=int, default=None, metavar="N",
              help="First tune every row with N trials of fl tune on a validation split (OUT/tune/ROW), then compare "
                   "each row at its given and at its tuned options, with Kendall's tau between the orders "
                   "(docs/tuning.md).")
@friendly_errors
def compare_command(plugins: str, seeds: str, config_file: Optional[str], sets: Tuple[str, ...], out_dir: str,
                    jobs: int, runs_per_device: Optional[int], launcher: Optional[str], launcher_config: Optional[str],
                    slurm_partition: Optional[str],
                    slurm_time: int, slurm_gpus: int, slurm_cpus: int, slurm_mem_gb: Optional[float],
                    slurm_account: Optional[str], slurm_array_parallelism: int, slurm_options: Tuple[str, ...],
                    progress: bool, tune_trials: Optional[int]) -> None:
    """Compare algorithms on the same data, partition and seeds: a results table and accuracy curves.

    Finished runs of an identical configuration already in OUT/runs are reused and interrupted ones resumed, so
    rerunning the same command continues an interrupted comparison where it stopped. A line is printed as each run
    ends (when standard output is not a terminal -- a log file, a pipe -- only that line: no per-round lines).
    Before a finished run is reused its files are verified (summary.json agrees with metrics.jsonl, every round
    logged, unchanged since it finished); one that does not verify, or that failed, is moved to OUT/unverified/ and
    run again. Only finished runs enter the table; when a run failed (its one-line reason is listed; the other runs go
    on) or is incomplete, the exit status is 1 (after Ctrl-C: 130; bad input: 2).
    """
    from ..results.compare import run_comparison

    algorithms = _specs(plugins)
    seed_list = _seeds(seeds)
    common, per_algo = _split_sets(sets)
    layers = []
    if config_file:
        layers.append(load_file(config_file))
    layers.append(parse_sets(common))
    algo_layers = {a: [parse_sets(items)] for a, items in per_algo.items()}
    click.echo(f"comparing {', '.join(algorithms)} over seeds {', '.join(map(str, seed_list))} -> {out_dir}"
               + (f" ({jobs} parallel jobs)" if jobs > 1 else ""))
    # a per-round bar or line only on a terminal: a log of N runs gets N lines, not N x rounds
    settings = launcher_settings(launcher_config, launcher, slurm_partition, slurm_time, slurm_gpus, slurm_cpus,
                                 slurm_mem_gb, slurm_account, slurm_array_parallelism, slurm_options)
    try:
        results = run_comparison(algorithms, seed_list, layers, Path(out_dir), progress=progress and _is_terminal(),
                                 algorithm_layers=algo_layers, jobs=jobs, echo=lambda line: click.echo(line),
                                 runs_per_device=runs_per_device, launcher=settings, tune_trials=tune_trials)
    except KeyboardInterrupt:  # --tune: a study stopped between or within trials; 130 and how to go on, as fl tune
        click.echo(f"interrupted; rerun the same command to continue (the studies in {Path(out_dir) / 'tune'} go on "
                   f"where they stopped, finished runs are reused)", err=True)
        raise SystemExit(130) from None
    if settings is not None and (results["submitted"] or results["waiting"]):
        echo_submission(results, f"{Path(out_dir) / 'jobs'}/")
        return
    click.echo(Path(results["files"]["markdown"]).read_text())
    click.echo(f"table: {results['files']['markdown']}  (json: {results['files']['json']}, csv: "
               f"{results['files']['csv']})\n"
               f"curves: {results['files']['plot']}\n"
               f"watch in TensorBoard: tensorboard --logdir {Path(out_dir) / 'runs'}")
    missing = results["not_in_table"]
    if missing:
        failed = sum(r["status"] == "failed" for r in missing)
        click.echo(f"{len(missing)} run(s) not in the table ({failed} failed, {len(missing) - failed} incomplete)"
                   + ("; rerun the same command to continue (finished runs are reused)" if results["interrupted"]
                      else ""), err=True)
        # failed or incomplete runs: a script must not take this table for the full comparison (Ctrl-C: 130, as
        # fl run)
        raise SystemExit(130 if results["interrupted"] else 1)
