"""Resuming a run (``fl run --resume DIR``): what is checked and loaded before the run continues.

``load_resume_point`` reads the saved configuration, applies the resume-safe overrides, and opens the checkpoint:
its header must match the configuration's fingerprint (an edited configuration or a checkpoint copied from another
run is refused) and its run state must be complete. A run that died (or was stopped) before its first checkpoint
starts again from round 0 in the same directory, with its saved configuration and partition; one whose
summary.json records that it failed before its first checkpoint is refused with one line (nothing to resume). Once the run's data is built,
``check_partition`` compares ``partition.json`` with the partition the checkpoint was computed on; once the run is
rebuilt, ``record_resume`` keeps the directory truthful (config.json, resumes.jsonl, run.log).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from easydict import EasyDict

from ..storage.checkpoint import CHECKPOINT_NAME, check_header, check_run_state, checkpoint_exists, open_checkpoint
from .config import check_resume_overrides, config_fingerprint, deep_merge, to_plain
from ..common.errors import CheckpointError, ConfigError
from ..storage.monitor import append_run_log
from ..storage.rundir import check_own_entries, is_dead_start, read_config_bytes, write_config
from ..common.safefiles import open_append
from ..common.threads import effective_threads

log = logging.getLogger("pflkit")


@dataclass
class ResumePoint:
    """Where a resumed run continues, and what the ``Simulation`` needs to continue it."""

    run_dir: Path
    cfg: EasyDict  # the saved configuration with the overrides applied
    overrides: Dict[str, Any]
    from_round: int  # rounds completed (0 for a restart)
    state: Optional[Mapping[str, Any]] = None  # the checkpoint's run state (client states read on use); None: restart
    partition_sha256: Optional[str] = None  # the partition the checkpoint was computed on
    threads_warning: Optional[str] = None  # the run resumes with another torch thread count than it was saved with

    @property
    def restart(self) -> bool:
        """No checkpoint: the run starts again from round 0 in its directory."""
        return self.state is None


def load_resume_point(run_dir: Path, overrides: Optional[Dict[str, Any]] = None) -> ResumePoint:
    """Check the run in ``run_dir`` and load what continuing it needs; ``overrides`` may change resume-safe keys
    only. Nothing is written here."""
    from .config import resolve

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if run_dir.is_dir():
        check_own_entries(run_dir)  # before anything is read or written there
    if is_dead_start(run_dir):
        raise CheckpointError(f"{run_dir} has nothing to resume: its run was stopped while starting, before it "
                              f"saved its configuration. Start it again with the original fl run command (the "
                              f"same run_name reuses this directory)")
    if not run_dir.is_dir() or not cfg_path.is_file():
        raise CheckpointError(f"{run_dir} is not a run directory (no config.json)")
    try:
        saved = json.loads(read_config_bytes(run_dir).decode("utf-8"))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{cfg_path} is corrupt ({exc}); restore it from a copy") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{cfg_path} is corrupt (not a JSON object); restore it from a copy")
    overrides = dict(overrides or {})
    check_resume_overrides(overrides)
    cfg = resolve([deep_merge(saved, overrides)])
    if not checkpoint_exists(run_dir):
        failure = _recorded_failure(run_dir)
        if failure is not None:
            raise CheckpointError(f"{run_dir} has no checkpoint to resume from: its run failed before its first "
                                  f"checkpoint ({failure}); its record stays there. Fix the cause, then start it "
                                  f"again in a new directory (another run_name), or remove {run_dir}")
        log.warning("%s has no checkpoint (the run stopped before its first one): starting it again from "
                    "round 0 with its saved configuration and partition", run_dir)
        return ResumePoint(run_dir, cfg, overrides, from_round=0)
    header, state = open_checkpoint(run_dir)  # client states are read one at a time while restoring
    check_header(header, run_dir / CHECKPOINT_NAME)
    if header.get("config_sha256") != config_fingerprint(cfg):
        raise CheckpointError(
            f"{cfg_path} does not match {run_dir / 'checkpoint.pt'} (checkpoint of algorithm "
            f"'{header.get('algorithm')}' after round {header.get('round')}): the configuration was edited "
            f"after the checkpoint was written, or the checkpoint belongs to another run. Restore the original "
            f"config.json; change only resume-safe keys, with --set on the resume command")
    check_run_state(state, header, run_dir / CHECKPOINT_NAME)
    done = header["round"]
    if cfg.rounds < done:
        raise ConfigError(f"rounds: {cfg.rounds} is invalid: the run has already completed {done} rounds")
    threads, now = header.get("torch_threads"), effective_threads(cfg)
    warning = None
    if threads is not None and threads != now:
        warning = (f"this run was checkpointed with {threads} torch threads and resumes with {now}: numbers will "
                   f"differ from an uninterrupted run from round {done + 1} on (resume with --set "
                   f"threads={threads} to match)")
        log.warning(warning)
    return ResumePoint(run_dir, cfg, overrides, from_round=done, state=state,
                       partition_sha256=header.get("partition_sha256"), threads_warning=warning)


def _recorded_failure(run_dir: Path) -> Optional[str]:
    """'in round N: reason' when the run's summary.json records a failure (status 'failed'); else None."""
    from ..storage.rundata import read_summary

    try:
        summary = read_summary(run_dir)
    except CheckpointError:
        return None  # a damaged summary says nothing: the run restarts as one that was killed
    if not summary or summary.get("status") != "failed":
        return None
    reason = str(summary.get("reason") or "no reason recorded")[:300]
    return f"in round {summary.get('stopped_in_round', '?')}: {reason}"


def check_partition(point: ResumePoint, partition_sha256: str) -> None:
    """Refuse a ``partition.json`` other than the one the checkpoint was computed on (``partition_sha256``: the
    SHA-256 of the partition the run rebuilt from it)."""
    if point.partition_sha256 is not None and point.partition_sha256 != partition_sha256:
        raise CheckpointError(f"{point.run_dir / 'partition.json'} does not match {point.run_dir / CHECKPOINT_NAME}: "
                              f"the partition was edited after the checkpoint was written (clients' samples moved "
                              f"or swapped); restore the original partition.json")


def record_resume(point: ResumePoint) -> None:
    """Keep the run directory truthful: config.json holds the values in force, resumes.jsonl the history, run.log
    the thread-count warning. Called by the process that writes the run directory, once the run is rebuilt."""
    if point.overrides:
        write_config(point.run_dir, to_plain(point.cfg))
    entry = {"time": datetime.now().isoformat(timespec="seconds"), "from_round": point.from_round,
             "overrides": point.overrides, "torch_threads": effective_threads(point.cfg)}
    with open_append(point.run_dir / "resumes.jsonl") as f:
        f.write(json.dumps(entry) + "\n")
    if point.threads_warning:
        append_run_log(point.run_dir, f"WARNING pflkit: {point.threads_warning}")
