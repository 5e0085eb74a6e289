"""``fl run``: start a run from an algorithm plugin, or resume an interrupted one."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional, Tuple

import click

from ..engine.config import RESUME_SAFE_KEYS, load_file, parse_sets, resolve
from ..common.errors import ConfigError
from ..storage.reporting import format_summary, report_result  # noqa: F401  (format_summary: imported from here too)
from .common import friendly_errors

INTERRUPTED = 130  # the shell's status for a process stopped by Ctrl-C


@click.command("run")
@click.option("--plugin", "-p", "plugin", help="Algorithm plugin to run (fl list algorithms).")
@click.option("--config", "-c", "config_file", type=click.Path(dir_okay=False), help="TOML or JSON config file.")
@click.option("--set", "-s", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config key, e.g. --set train.lr=0.01 (repeatable).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
              help="Continue the interrupted run in this run directory (--set may change "
                   f"{', '.join(RESUME_SAFE_KEYS)}).")
@click.option("--no-progress", is_flag=True, help="Do not draw the progress bar.")
@click.option("--workers", type=int, default=None, metavar="N",
              help="Run the clients in N local processes (torch.distributed: gloo, plus NCCL on GPUs); same "
                   "numbers as one process.")
@click.option("--artifacts", "artifacts_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Share set-up results with other runs through DIR (e.g. PCFL's flow with a fixed "
                   "aggregator.flow_seed: trained once, loaded by the next run; docs/reproducing.md). fl compare "
                   "and fl reproduce share through OUT/artifacts.")
@friendly_errors
def run_command(plugin: Optional[str], config_file: Optional[str], sets: Tuple[str, ...],
                resume_dir: Optional[str], no_progress: bool, workers: Optional[int],
                artifacts_dir: Optional[str]) -> None:
    """Run a federated experiment (Ctrl-C stops after the current round and leaves a resumable run)."""
    from ..engine.simulation import Simulation

    if workers is not None or _torchrun_endpoint() is not None:
        if artifacts_dir:
            raise ConfigError("--artifacts: a distributed run (--workers, torchrun) shares no set-up results: its "
                              "processes must all take the same path; run without --artifacts")
        try:
            code = _run_distributed(plugin, config_file, sets, resume_dir, no_progress, workers)
        except KeyboardInterrupt:  # before any process started (later ones are handled where they happen)
            click.echo("interrupted during start-up; nothing was run", err=True)
            code = INTERRUPTED
        _finish(code)
    sim = None
    shared = Path(artifacts_dir) if artifacts_dir else None
    try:
        if resume_dir:
            if plugin or config_file:
                raise ConfigError("--resume continues a run with its saved config; do not combine it with "
                                  "--plugin or --config (--set may change resume-safe keys such as rounds)")
            sim = Simulation.resume(Path(resume_dir), overrides=parse_sets(sets), progress=not no_progress,
                                    artifacts_dir=shared)
            click.echo(f"resuming {sim.run_dir} after round {sim.completed_round}")
        else:
            layers = []
            if config_file:
                layers.append(load_file(config_file))
            layers.append(parse_sets(sets))
            if plugin is None and not any("algorithm" in layer for layer in layers):
                raise ConfigError("name an algorithm: fl run --plugin NAME (fl list algorithms shows them)")
            cfg = resolve(layers, algorithm=plugin)
            sim = Simulation(cfg, progress=not no_progress, artifacts_dir=shared)
            click.echo(f"run directory: {sim.run_dir}")
    except KeyboardInterrupt:
        if sim is not None:  # built, not run: a fresh run's directory goes (nothing half-made stays)
            sim.abandon()
        click.echo("interrupted during start-up; nothing was run", err=True)
        sys.exit(INTERRUPTED)
    try:
        result = sim.run()
        interrupted = report_result(result, sim.run_dir)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, the last checkpoint stays usable
        click.echo(stopped_message(sim.run_dir), err=True)
        _finish(INTERRUPTED)
    _finish(INTERRUPTED if interrupted else 0)  # 130 so that 'fl run ... && next' stops


def _finish(code: int) -> None:
    """Exit with ``code``. The run is over: in the fl command a later Ctrl-C (pressed again while the process
    exits) no longer changes the status or ends it in a traceback."""
    from ..cli_start import is_fl_command

    if is_fl_command():  # not in a process that merely calls the command (tests, notebooks)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def stopped_message(run_dir: Path) -> str:
    """What a run stopped at once by Ctrl-C says: how to continue, or that there is nothing to continue (a fresh
    run stopped before round 1 leaves no directory; one stopped during its rounds keeps its record)."""
    from ..storage.checkpoint import checkpoint_exists

    if checkpoint_exists(run_dir):
        return f"stopped; continue from the last checkpoint with:\n  fl run --resume {run_dir}"
    if Path(run_dir).is_dir():
        return (f"stopped before the first checkpoint; the record of its rounds stays in {run_dir}; start it "
                f"again from round 0 with:\n  fl run --resume {run_dir}")
    return "stopped before the first checkpoint; nothing to resume"


def _torchrun_endpoint():
    from ..distributed.worker import torchrun_endpoint

    return torchrun_endpoint()


def _run_distributed(plugin: Optional[str], config_file: Optional[str], sets: Tuple[str, ...],
                     resume_dir: Optional[str], no_progress: bool, workers: Optional[int]) -> int:
    """``--workers N`` starts N local processes; under torchrun (RANK, WORLD_SIZE, ... set) this process is one."""
    import logging

    from ..distributed.launch import launch_local
    from ..distributed.worker import RunRequest, run_process, torchrun_endpoint

    req = RunRequest(plugin, config_file, tuple(sets), resume_dir, not no_progress,
                     verbose=logging.getLogger().level <= logging.DEBUG)
    endpoint = torchrun_endpoint()
    if endpoint is not None:
        if workers is not None:
            raise ConfigError("--workers starts its own processes; under torchrun use --nproc-per-node instead")
        from ..distributed.signals import TERMINATED, Terminated, raise_on_sigterm

        signal.signal(signal.SIGTERM, raise_on_sigterm)  # how torchrun stops workers: unwind, nothing half-made
        try:
            return run_process(req, endpoint)
        except Terminated:
            return TERMINATED
    return launch_local(req, workers)
