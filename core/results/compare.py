"""Run several algorithms on the same dataset, partition and seeds; tabulate and plot the results.

``run_comparison(["fedavg", "fedprox"], [0, 1, 2], layers, out_dir)`` runs every (algorithm, seed) pair with the
same user layers (file and ``--set`` overrides; ``seed`` is then set per run), each in
``out_dir/runs/<algorithm>-seed<k>``, and writes

- ``results.json``: per run the summary numbers, per algorithm mean and std over seeds;
- ``results.md``: the same as a Markdown table;
- ``curves.png``: the uniform and sample-weighted test metric per evaluated round, one curve per algorithm
  (mean over seeds, shaded band = std over seeds).

An entry may be a labelled *variant*: ``"fedcac+aggregator.collaboration=local"`` runs fedcac with that setting
on top of the shared layers (``NAME+key=value[+key=value...]``); its row is labelled with the whole spec and its run
directories use a filesystem-safe form of it. ``jobs=N`` runs N runs at a time in worker processes. Every run uses
one torch thread, serial ones included (CPU kernels may round differently with another thread count), and every
run is seeded, so the numbers do not depend on ``jobs``: use ``jobs`` to use more cores. To keep one partition across run seeds,
set ``partition.seed``.

Only finished runs enter the statistics. A run that fails (its one-line reason is recorded) does not stop the
others; failed, interrupted and never-started runs are listed with their round counts under ``not_in_table``.

Std over seeds is the population std (numpy's default, ddof=0), as PFLlib reports it. A run directory that already
holds a finished run with the identical configuration is reused instead of rerun once its files verify (see
``_existing_run``: finished status, every round logged, summary numbers re-derived from ``metrics.jsonl``, the
sha256 digests of ``verified.json``), and an interrupted one (Ctrl-C leaves a checkpoint) is resumed, so an
interrupted or extended comparison picks up where it stopped. A run that does not verify or that failed is moved
to ``out_dir/unverified/`` and run again; a run directory of a different configuration is an error.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import multiprocessing
import os
import re
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..storage.checkpoint import CHECKPOINT_NAME
from ..engine.config import parse_sets, resolve, to_plain, without_neutral_defaults
from ..common.errors import CheckpointError, ConfigError
from ..storage.rundata import (JSON_LIMIT, METRICS_LIMIT, METRICS_NAME, PLOT_LIMIT, finished_run_problem, read_json, read_config, selected_values,
                               read_records, read_summary)
from ..common.userkey import verify_key
from ..common.safefiles import read_regular, write_atomic
from .placement import Placement, pin_worker, plan_placement

log = logging.getLogger("pflkit")

STATS = ("final_uniform", "best_uniform", "final_weighted")
GLOBAL_STATS = ("final_global_uniform", "final_global_weighted")  # the global model's, where a run has one
SELECTED_STATS = ("selected_uniform", "selected_weighted", "selected_per_client")  # split.val: chosen on validation


def _global_finals(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """A run's global-model finals (summary.json's ``global``: core/engine/globaleval.py); {} without a global model
    (``global`` null) or from a run that predates it."""
    glob = summary.get("global")
    if not isinstance(glob, dict):
        return {"has_global_model": False} if "global" in summary else {}
    final = glob.get("final") or {}
    return {"has_global_model": True, "final_global_uniform": final.get("uniform"),
            "final_global_weighted": final.get("weighted")}


def _mean_std(values: Sequence[float]) -> Dict[str, float]:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": float(arr.mean()), "std": float(arr.std()), "n": int(arr.size)}


def _read_curve(run_dir: Path, metric: str) -> Tuple[Dict[str, List[float]], float]:
    """Evaluated rounds and their uniform / weighted metric from a run's ``metrics.jsonl``, and the seconds the
    run spent in its rounds (training + evaluations, as logged per round). The file is read as untrusted data
    (``rundata.read_records``: bounded, regular files only, strict JSON); a value that is not a number counts as
    absent."""
    rounds, uniform, weighted = [], [], []
    seconds = 0.0
    for row in read_records(run_dir / "metrics.jsonl"):
        seconds += _finite(row.get("round_seconds"), 0.0) + _finite(row.get("eval_seconds"), 0.0) + \
            _finite(row.get("global_eval_seconds"), 0.0)  # the global model's evaluation, where it has its own
        value = _finite(row.get(f"{metric}/uniform"), None)
        if value is not None:
            rounds.append(row["round"])
            uniform.append(value)
            weighted.append(_finite(row.get(f"{metric}/weighted"), math.nan))
    return {"rounds": rounds, "uniform": uniform, "weighted": weighted}, seconds


def _finite(value: Any, default: Any) -> Any:
    """``value`` as a float when it is a finite number, else ``default``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            return default
        if math.isfinite(value) and abs(value) <= PLOT_LIMIT:  # a larger one is no metric: the file is damaged
            return value
    return default


# what a reused finished run's summary must hold (read by _run_record)
_REUSED_FIELDS = ("metric", "rounds_completed", "final.uniform", "final.weighted", "final.k", "best.uniform",
                  "best.round", "bytes_up_total")


def _has(summary: Mapping[str, Any], dotted: str) -> bool:
    head, _, tail = dotted.partition(".")
    return head in summary and (not tail or (isinstance(summary[head], dict) and tail in summary[head]))


VERIFIED_NAME = "verified.json"  # compare's record of a finished run's files (sha256), written as it finishes
_VERIFIED_FILES = ("summary.json", METRICS_NAME)  # config.json is compared by meaning (neutral keys)


def _file_digests(run_dir: Path) -> Dict[str, str]:
    """sha256 of the files a reused run's numbers come from (read as untrusted data: regular files, bounded)."""
    out = {}
    for name in _VERIFIED_FILES:
        limit = METRICS_LIMIT if name == METRICS_NAME else JSON_LIMIT
        try:
            out[name] = hashlib.sha256(read_regular(run_dir / name, limit)).hexdigest()
        except FileNotFoundError:
            out[name] = "absent"
        except OSError as exc:
            raise CheckpointError(f"{run_dir / name} cannot be read ({exc.strerror or exc})") from None
    return out


def _keyed(digests: Mapping[str, str]) -> str:
    return hmac.new(verify_key(), json.dumps(dict(digests), sort_keys=True).encode(), hashlib.sha256).hexdigest()


def record_verified(run_dir: Path) -> None:
    """Write ``run_dir/verified.json``: the digests of a finished run's files and their digest keyed with this
    user's secret (``verify_key``), checked before the run is reused."""
    digests = _file_digests(Path(run_dir))
    write_atomic(Path(run_dir) / VERIFIED_NAME, json.dumps({"sha256": digests, "hmac": _keyed(digests)}, indent=2))


def _digest_problem(run_dir: Path) -> Optional[str]:
    """Why ``run_dir`` cannot be reused as verified (None: its files match the digests recorded when compare saw it
    finish, and those digests carry this user's key). A run without ``verified.json`` -- deleted, or a run from
    before pflkit recorded one -- or with digests not keyed by this user's pflkit (recomputed after an edit, from
    an older pflkit, copied from another machine) runs again."""
    try:
        recorded = read_json(run_dir / VERIFIED_NAME)
    except CheckpointError as exc:
        return f"{VERIFIED_NAME} is unreadable ({str(exc).split('; ')[0].split(': ')[-1]})"
    if recorded is None:
        return f"it has no {VERIFIED_NAME} (the digests compare records when it sees a run finish)"
    digests = recorded.get("sha256")
    if not isinstance(digests, dict):
        return f"{VERIFIED_NAME} holds no digests"
    keyed = recorded.get("hmac")
    if not isinstance(keyed, str) or not hmac.compare_digest(keyed, _keyed(digests)):
        return (f"its {VERIFIED_NAME} was not written by this user's pflkit (its keyed digest "
                f"{'is missing' if not isinstance(keyed, str) else 'differs'}: edited, from an older pflkit, or "
                f"copied from another machine)")
    now = _file_digests(run_dir)
    for name in _VERIFIED_FILES:
        if digests.get(name) != now[name]:
            return f"{name} changed after the run finished (its sha256 differs from {VERIFIED_NAME})"
    return None


def _existing_run(run_dir: Path, cfg: Mapping[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """What ``run_dir`` holds for ``cfg``, and why when it cannot be reused: (None, None) nothing; ('finished',
    None) a verified finished run (reuse it); ('resume', None) an interrupted run of the same configuration with a
    checkpoint; ('rerun', reason) a run of the same configuration that failed or whose files do not verify
    (edited, truncated): it is moved aside and run again. Anything else is an error: it is never silently
    overwritten.

    Verified means: the summary says finished (no 'failed' status, all rounds), ``metrics.jsonl`` logs every round
    and gives the summary's final and best numbers (``rundata.finished_run_problem``), and the files still have the
    sha256 digests recorded when compare saw the run finish (``verified.json``, when there is one)."""
    if not run_dir.exists():
        return None, None
    try:
        # keys added since the run was made count as equal at their neutral values (config.NEUTRAL_DEFAULTS)
        same_config = without_neutral_defaults(read_config(run_dir)) == without_neutral_defaults(to_plain(cfg))
    except CheckpointError:
        same_config = False
    summary = read_summary(run_dir) if same_config else None  # a damaged summary is one line naming it
    if same_config:
        failed = summary is not None and summary.get("status") == "failed"
        if summary is not None and not failed and not summary.get("interrupted") \
                and summary.get("rounds_completed") == cfg["rounds"]:
            missing = [k for k in _REUSED_FIELDS if not _has(summary, k)]
            if missing:
                raise CheckpointError(f"{run_dir / 'summary.json'} lacks '{missing[0]}', which a finished run's "
                                      f"summary has; the file is damaged: remove {run_dir} to run it again")
            problem = finished_run_problem(summary, read_records(run_dir / METRICS_NAME), int(cfg["rounds"]),
                                           int(cfg["eval"]["final_k"])) or _digest_problem(run_dir)
            return ("rerun", problem) if problem else ("finished", None)
        if (run_dir / CHECKPOINT_NAME).exists():
            return "resume", None
        if failed:
            return "rerun", f"it failed ({_one_line(summary.get('reason')) or 'no reason recorded'})"
    if summary is None and not (run_dir / CHECKPOINT_NAME).exists() and _dead_start(run_dir, same_config):
        return "rerun", "its start was stopped before round 1 (no checkpoint, no summary, no live process holds it)"
    raise CheckpointError(f"{run_dir} already exists and is neither a finished run nor a resumable checkpoint of "
                          f"the same configuration; remove it or choose another --out folder")


# what a run directory holds before its first checkpoint (core/storage/rundir.py, monitor.py)
_START_FILES = {".lock", "config.json", "partition.json", "run.log", "run_info.json", "tb", "metrics.jsonl",
                "spill", "server_spill"}


def _dead_start(run_dir: Path, same_config: bool) -> bool:
    """Whether ``run_dir`` is a start killed before round 1: only a start's files (or the same configuration's
    config.json) and no live fl process holding its lock. A live one is one line (never moved under its feet)."""
    from ..storage.rundir import RunDirLock

    try:
        names = {p.name for p in run_dir.iterdir()}
    except OSError:
        return False
    if not names <= _START_FILES or not (same_config or "config.json" not in names):
        return False
    lock = RunDirLock(run_dir)
    lock.acquire()  # CheckpointError naming the live process when one holds it
    lock.release()
    return True


def _one_line(text: Any, limit: int = 160) -> str:
    line = str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _move_aside(run_dir: Path, out_dir: Path) -> Path:
    """Move a run directory that is not reused to ``OUT/unverified/<name>[-n]`` (kept, never deleted)."""
    aside = out_dir / "unverified"
    try:
        aside.mkdir(exist_ok=True)
        for n in range(10_000):
            dest = aside / (run_dir.name if n == 0 else f"{run_dir.name}-{n}")
            if not os.path.lexists(dest):
                os.rename(run_dir, dest)
                return dest
    except OSError as exc:
        raise CheckpointError(f"cannot move {run_dir} aside to {aside} ({exc.strerror or exc}); remove it to run "
                              f"it again") from None
    raise CheckpointError(f"{aside} is full of earlier copies of {run_dir.name}; remove them")


@dataclass(frozen=True)
class Entry:
    """One row of the comparison: an algorithm, optionally with variant settings (``fedcp+trainer.lambda_mmd=1``)."""

    label: str                     # the spec as given: the row's name
    algorithm: str                 # the registered algorithm
    sets: Tuple[str, ...]          # the variant's ``key=value`` settings, in order
    dir_name: str                  # filesystem-safe form of the label: runs/<dir_name>-seed<k>


def parse_entry(spec: str) -> Entry:
    """``"fedcac+aggregator.collaboration=local+aggregator.tau=0.3"`` -> Entry; a bare name is the algorithm.

    A ``+`` inside a value (``train.lr=1e+3``) stays part of the value: a piece without ``=`` continues the
    previous setting. Raises ConfigError for a spec that is not ``NAME[+key=value...]``.
    """
    text = str(spec).strip()
    name, *pieces = text.split("+")
    name = name.strip()
    if not name or "=" in name or "." in name or ":" in name:
        raise ConfigError(f"compare: {spec!r} is not ALGORITHM or ALGORITHM+key=value[+key=value...] "
                          f"(e.g. fedprox+trainer.mu=0.1)")
    sets: List[str] = []
    for piece in pieces:
        if "=" in piece or not sets:
            if "=" not in piece or not piece.partition("=")[0].strip():
                raise ConfigError(f"compare: variant {spec!r}: {piece.strip()!r} is not key=value "
                                  f"(variants are ALGORITHM+key=value[+key=value...])")
            sets.append(piece.strip())
        else:  # '+' inside a value, e.g. 1e+3
            sets[-1] += "+" + piece
    label = "+".join([name, *sets])
    return Entry(label=label, algorithm=name, sets=tuple(sets), dir_name=_safe_name(label))


def _safe_name(label: str) -> str:
    """A directory name for a label: letters, digits and ``._=+-`` kept, runs of anything else -> ``_``; a long
    label is shortened and made unique with a hash of the full label."""
    safe = re.sub(r"[^A-Za-z0-9._=+-]+", "_", label).strip("._") or "run"
    if len(safe) > 100:
        safe = f"{safe[:80]}-{hashlib.sha1(label.encode()).hexdigest()[:10]}"
    return safe


def _plan(specs: Sequence[str], seeds: Sequence[int], layers: Sequence[Mapping[str, Any]],
          algorithm_layers: Mapping[str, Sequence[Mapping[str, Any]]]):
    if not specs:
        raise ConfigError("compare: name at least one algorithm (--plugins fedavg,fedprox)")
    entries = [s if isinstance(s, Entry) else parse_entry(s) for s in specs]  # a tuned row comes as an Entry
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"compare: an algorithm is listed twice in {', '.join(labels)}")
    dirs: Dict[str, str] = {}
    for e in entries:
        if e.dir_name in dirs:
            raise ConfigError(f"compare: '{e.label}' and '{dirs[e.dir_name]}' would share the run directory "
                              f"runs/{e.dir_name}-seed<k>; write one of them differently")
        dirs[e.dir_name] = e.label
    if not seeds:
        raise ConfigError("compare: give at least one seed (--seeds 0,1,2)")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"compare: a seed is listed twice in {', '.join(map(str, seeds))}")
    names = {e.algorithm for e in entries}
    stray = sorted(set(algorithm_layers) - names)
    if stray:
        raise ConfigError(f"compare: settings given for '{stray[0]}', which is not among the compared "
                          f"algorithms ({', '.join(sorted(names))})")
    # resolve everything before running anything: a typo must not surface after an hour of training
    plan: Dict[Tuple[Entry, int], Any] = {}
    for entry in entries:
        algo = entry.algorithm
        try:
            variant = [parse_sets(entry.sets)] if entry.sets else []
        except ConfigError as exc:
            raise ConfigError(f"{entry.label}: {exc}") from None
        for seed in seeds:
            try:
                # shared layers < ALGO:key=value (every variant of ALGO) < the variant's own settings < run seed
                plan[entry, seed] = resolve([*layers, *algorithm_layers.get(algo, ()), *variant,
                                             {"seed": int(seed)}], algorithm=algo)
            except ConfigError as exc:  # name the algorithm: a key may exist for one trainer and not another
                raise ConfigError(f"{entry.label}: {exc} (a key for one algorithm only: --set {algo}:KEY=VALUE)"
                                  ) from None
    return entries, plan


def _init_worker() -> None:
    """One torch thread per worker process: N parallel runs share the CPU cores instead of oversubscribing them."""
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Serial runs use one torch thread too: CPU kernels (convolutions, BatchNorm reductions) can round
    differently with another thread count, and ``jobs`` must not change the numbers."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


ARTIFACTS_DIR = "artifacts"  # OUT/artifacts: the set-up results a comparison's runs share


def _execute(cfg: Any, run_dir: Path, state: Optional[str], progress: bool,
             on_setup: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Run (state None) or resume (state 'resume') one run; its summary. Each run logs to TensorBoard in its own
    ``tb/`` (``tensorboard --logdir OUT/runs`` shows every run of the comparison side by side). ``on_setup``
    receives the run's set-up lines (a set-up can take minutes without a round line)."""
    from ..engine.simulation import Simulation

    shared = artifacts_of(Path(run_dir))
    if state == "resume":
        return Simulation.resume(run_dir, progress=progress, artifacts_dir=shared).run(on_setup=on_setup)
    return Simulation(cfg, run_dir=run_dir, progress=progress, artifacts_dir=shared).run(on_setup=on_setup)


def artifacts_of(run_dir: Path) -> Path:
    """Where a comparison's runs (``OUT/runs/NAME``) share set-up results (core.api.artifacts): ``OUT/artifacts``."""
    return run_dir.parent.parent / ARTIFACTS_DIR


def _reason(exc: BaseException) -> str:
    """One line for a failed run: a user-facing error's own message, a bug's type and message."""
    from ..common.errors import PflError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, PflError) and text else f"{type(exc).__name__}: {text}".rstrip(": ")


def _run_parallel(pending: Sequence[Tuple[Entry, int, Any, Path, Optional[str]]], workers: int,
                  summaries: Dict[Path, Dict[str, Any]], failures: Dict[Path, str],
                  finished: Callable[[Path], None], placement: Optional[Placement] = None) -> bool:
    """Run ``pending`` in ``workers`` processes, filling ``summaries`` (or ``failures`` with a run's one-line
    reason) and calling ``finished(run_dir)`` as each run ends; True when interrupted.

    Ctrl-C reaches the workers too (same process group): each finishes its round, checkpoints and returns an
    interrupted summary; runs not started yet are cancelled. Rerunning the comparison resumes them. A run that
    fails does not stop the others.
    """
    interrupted = False
    if placement is None:
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker)
    else:  # each worker takes one GPU from the queue for its whole life (core/results/placement.py)
        context = multiprocessing.get_context("spawn")  # never fork a process that asked CUDA for its GPUs
        slots = context.Queue()
        for index, gpu in enumerate(placement.slots()):
            slots.put((gpu, index, placement.runs_per_device))
        pool = ProcessPoolExecutor(max_workers=placement.workers, mp_context=context, initializer=pin_worker,
                                   initargs=(slots,))
    futures: Dict[Future, Path] = {}
    try:
        for entry, seed, cfg, run_dir, state in pending:
            log.info("compare: %s %s with seed %d in %s", "resuming" if state else "queueing", entry.label, seed,
                     run_dir)
            futures[pool.submit(_execute, cfg, run_dir, state, False)] = run_dir
        waiting = set(futures)
        while waiting:
            try:
                done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            except KeyboardInterrupt:
                log.warning("compare: interrupted; waiting for the running runs to checkpoint")
                interrupted = True
                for fut in waiting:
                    fut.cancel()
                continue
            for fut in done:
                if fut.cancelled():
                    continue
                run_dir = futures[fut]
                try:
                    summary = fut.result()
                except Exception as exc:  # a worker's PflError, a plugin bug or a crashed worker: this run only
                    log.debug("compare: run %s failed", run_dir, exc_info=exc)
                    failures[run_dir] = _reason(exc)
                    finished(run_dir)
                    continue
                summaries[run_dir] = summary
                finished(run_dir)
                if summary.get("interrupted") and not interrupted:
                    interrupted = True
                    for other in waiting:
                        other.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return interrupted


def _logged_rounds(run_dir: Path) -> Tuple[int, int]:
    """The last round a run's ``metrics.jsonl`` records and the client replies rejected in its rounds (for a
    failed run, which has no summary); an unreadable log counts as no round."""
    try:
        rows = read_records(run_dir / "metrics.jsonl")
    except CheckpointError:
        return 0, 0
    rejected = sum(int(_finite(row.get("client_failures"), 0.0)) for row in rows)
    if (run_dir / "summary.json").exists():  # a failed run's summary also counts the failing round's rejections
        with contextlib.suppress(CheckpointError, ConfigError):
            recorded = read_summary(run_dir).get("client_failures")
            rejected = max(rejected, int(_finite(recorded, 0.0)))
    return (rows[-1]["round"] if rows else 0), rejected


def _status_text(value: Optional[float], metric: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.4f}"


def progress_line(done: int, total: int, run: Mapping[str, Any], metric: str) -> str:
    """``[3/6] fedavg seed 1: finished 10/10 rounds, final accuracy 88.12% (uniform), 12.3 s`` -- one line per
    run as it ends (or is reused), so a long comparison shows where it is, also with ``jobs`` > 1."""
    head = f"[{done}/{total}] {run['label']} seed {run['seed']}: "
    rounds = f"{run['rounds_completed']}/{run['rounds']} rounds"
    rejected = run.get("client_failures") or 0
    tail = f", {rejected} client replies rejected" if rejected else ""
    if run["status"] == "failed":
        return f"{head}FAILED after {rounds}: {run['reason']}{tail}"
    if run["status"] == "incomplete":
        return f"{head}incomplete, {rounds} (interrupted; rerun the same command to continue){tail}"
    verb = "reused, finished earlier:" if run.get("reused") else "finished"
    return (f"{head}{verb} {rounds}, final {metric} {_status_text(run.get('final_uniform'), metric)} (uniform), "
            f"{run.get('seconds', 0.0):.1f} s{tail}")


def run_comparison(algorithms: Sequence[str], seeds: Sequence[int], layers: Sequence[Mapping[str, Any]],
                   out_dir: Path, progress: bool = False,
                   algorithm_layers: Optional[Mapping[str, Sequence[Mapping[str, Any]]]] = None,
                   jobs: int = 1, echo: Optional[Callable[[str], None]] = None,
                   runs_per_device: Optional[int] = None, launcher: Optional[Any] = None,
                   tune_trials: Optional[int] = None) -> Dict[str, Any]:
    """Run every algorithm (or variant) with every seed on the same configuration layers; write results and plots.

    ``algorithms`` are names or variant specs ``NAME+key=value[+key=value...]`` (each its own labelled row).
    ``layers`` (file, ``--set``) apply to every entry; ``algorithm_layers[name]`` only to the entries of that
    algorithm, variants included (e.g. ``trainer.mu`` for fedprox, a key the other trainers do not have); a
    variant's own settings outrank both. ``jobs`` > 1 runs that many runs at a time in worker processes (one torch
    thread each, as serial runs have; no progress bars); when the runs compute on CUDA, each worker is pinned to one
    visible GPU, ``runs_per_device`` workers per GPU (core/results/placement.py). With ``launcher`` (a
    ``launchers.LauncherSettings``) the runs still to do are submitted as a job array instead (core/results/launchers.py)
    and the results hold the finished ones, with ``submitted`` (job ids) and ``waiting`` (runs whose job still runs).
    ``echo`` receives one :func:`progress_line` per run as it
    ends. A run that fails (e.g. every selected client failed in a round) is recorded with its one-line reason and
    the others go on. Only finished runs enter the statistics; failed, interrupted and never-started runs are
    listed under ``not_in_table`` (and in the table's notes) with their round counts. Returns the content of
    ``results.json`` plus the written file paths under ``files``. ``tune_trials`` N: every row is first tuned with N
    trials on a validation split and compared also at its best options (core/results/tuned.py).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"compare: jobs must be a positive integer, got {jobs!r}")
    out_dir = Path(out_dir)
    tuning = None
    if tune_trials is not None:
        from .tuned import tune_rows, with_validation

        _plan(list(algorithms), [int(s) for s in seeds], list(layers), dict(algorithm_layers or {}))  # typos first
        layers, note = with_validation(layers, parse_entry(list(algorithms)[0]).algorithm)
        if note:
            (echo or log.warning)(note)
        algorithms, tuning = tune_rows(list(algorithms), layers, dict(algorithm_layers or {}), tune_trials, out_dir,
                                       jobs, echo or (lambda line: log.info("compare: %s", line)))
    entries, plan = _plan(list(algorithms), [int(s) for s in seeds], list(layers), dict(algorithm_layers or {}))
    if runs_per_device is not None:  # refused before anything runs when it cannot apply
        plan_placement([cfg.device for cfg in plan.values()], max(2, jobs), runs_per_device)
    runs_root = out_dir / "runs"
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {runs_root}: {exc.strerror}") from exc

    # what each run directory holds, checked for every run before any training starts
    tasks = []
    reruns = []
    for (entry, seed), cfg in plan.items():
        run_dir = runs_root / f"{entry.dir_name}-seed{seed}"
        state, why = _existing_run(run_dir, cfg)
        if state == "rerun":
            reruns.append((run_dir, why))
            state = None
        tasks.append((entry, seed, cfg, run_dir, state))
    for run_dir, why in reruns:  # only once every directory is known good: nothing moves before an error
        dest = _move_aside(run_dir, out_dir)
        line = f"{run_dir.name}: not reused, {why}; moved to {dest}, running it again"
        if echo is not None:
            echo(line)
        else:
            log.warning("compare: %s", line)

    summaries: Dict[Path, Dict[str, Any]] = {}
    failures: Dict[Path, str] = {}
    by_dir = {t[3]: t for t in tasks}
    reported = [0]

    def finished(run_dir: Path) -> None:
        reported[0] += 1
        entry, seed, cfg, _, state = by_dir[run_dir]
        run = _run_record(entry, seed, cfg, run_dir, summaries.get(run_dir), failures.get(run_dir))
        run["reused"] = state == "finished"
        if run["status"] == "finished" and (state != "finished" or not (run_dir / VERIFIED_NAME).exists()):
            try:  # the digests a later comparison checks before reusing this run
                record_verified(run_dir)
            except (OSError, CheckpointError) as exc:
                log.warning("compare: cannot record %s in %s (%s); the run is verified by its numbers when "
                            "reused", VERIFIED_NAME, run_dir, exc)
        if echo is not None:
            echo(progress_line(reported[0], len(tasks), run, run.get("metric") or "accuracy"))

    interrupted = False
    pending = [t for t in tasks if t[4] != "finished"]
    submitted: List[str] = []
    waiting: List[str] = []
    if launcher is not None:  # the cluster runs them: submit (or leave alone), then tabulate what is finished
        from .launchers import submit

        new_jobs, left = submit(pending, out_dir, launcher, echo or (lambda line: None))
        submitted = [str(job.job_id) for job in new_jobs]
        waiting = [run_dir.name for run_dir in left]
        pending = []
    for entry, seed, _, run_dir, state in tasks:
        if state == "finished":
            log.info("compare: reusing the finished run in %s", run_dir)
            summaries[run_dir] = read_summary(run_dir)
            finished(run_dir)
    if jobs == 1 or len(pending) <= 1:
        with _one_torch_thread():
            for entry, seed, cfg, run_dir, state in pending:
                log.info("compare: %s %s with seed %d in %s", "resuming" if state else "running", entry.label,
                         seed, run_dir)
                try:
                    says = None if echo is None or progress else \
                        (lambda line, head=f"{entry.label} seed {seed}: ": echo(head + line))
                    summaries[run_dir] = _execute(cfg, run_dir, state, progress, says)
                except Exception as exc:  # this run failed; the comparison goes on without it
                    log.debug("compare: run %s failed", run_dir, exc_info=exc)
                    failures[run_dir] = _reason(exc)
                finished(run_dir)
                if run_dir in summaries and summaries[run_dir].get("interrupted"):
                    interrupted = True
                    break
    else:
        workers = min(jobs, len(pending))
        placement = plan_placement([t[2].device for t in pending], workers, runs_per_device)
        if placement is not None and echo is not None:
            echo(placement.describe(workers))
        interrupted = _run_parallel(pending, workers, summaries, failures, finished, placement)

    per_algo: Dict[str, Dict[str, Any]] = {
        e.label: {"algorithm": e.algorithm, "settings": parse_sets(e.sets), "runs": [], "runs_planned": len(seeds)}
        for e in entries}
    not_in_table: List[Dict[str, Any]] = []
    metric = None
    for entry, seed, cfg, run_dir, _ in tasks:
        row = per_algo[entry.label]
        row.setdefault("model", cfg.model.name)
        row.setdefault("trainer", cfg.trainer.name)
        row.setdefault("aggregator", cfg.aggregator.name)
        run = _run_record(entry, seed, cfg, run_dir, summaries.get(run_dir), failures.get(run_dir))
        if run["status"] != "finished":
            interrupted = interrupted or (run["status"] == "incomplete" and launcher is None)
            not_in_table.append({k: run[k] for k in ("label", "seed", "status", "rounds_completed", "rounds",
                                                      "reason", "client_failures", "run_dir")})
            continue
        metric = metric or run["metric"]
        row["runs"].append({k: v for k, v in run.items() if k not in ("label", "status", "reason", "metric")})

    for entry in per_algo.values():
        for stat in STATS:
            entry[stat] = _mean_std([r[stat] for r in entry["runs"]])
        for stat in GLOBAL_STATS + SELECTED_STATS:
            if any(stat in r for r in entry["runs"]):
                entry[stat] = _mean_std([r.get(stat) for r in entry["runs"]])
        entry["bytes_up_total"] = _mean_std([r["bytes_up_total"] for r in entry["runs"]])
        entry["seconds"] = _mean_std([r["seconds"] for r in entry["runs"]])
        entry["client_failures"] = int(sum(r["client_failures"] for r in entry["runs"]))
    first_cfg = next(iter(plan.values()))
    models = {e["model"] for e in per_algo.values() if e["runs"]}
    notes = []
    if len(models) > 1:
        notes.append("the algorithms' defaults use different models (" + ", ".join(
            f"{a}: {e['model']}" for a, e in per_algo.items() if e["runs"]) + "); set model.name to compare "
            "on one model")
    results: Dict[str, Any] = {
        "metric": metric or "accuracy", "algorithms": [e.label for e in entries], "seeds": [int(s) for s in seeds],
        "dataset": first_cfg.dataset.name, "partition": to_plain(first_cfg.partition),
        "rounds": first_cfg.rounds,
        "final_k": max((r["final_k"] for e in per_algo.values() for r in e["runs"]), default=first_cfg.eval.final_k),
        "std": "population std over seeds (ddof=0)", "jobs": jobs,
        "interrupted": interrupted, "complete": not not_in_table, "not_in_table": not_in_table,
        "notes": notes, "results": per_algo,
    }
    if launcher is not None:
        results.update({"launcher": launcher.name, "submitted": submitted, "waiting": waiting})
    if tuning is not None:
        from .tuned import kendall_tau

        results["tuning"] = {**tuning, "kendall_tau": kendall_tau(results, tuning)}
    files = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "csv": out_dir / "results.csv",
             "plot": out_dir / "curves.png"}
    files["json"].write_text(json.dumps(results, indent=2))
    files["markdown"].write_text(results_markdown(results))
    files["csv"].write_text(results_data(results))
    plot_curves(results, files["plot"])
    results["files"] = {k: str(v) for k, v in files.items()}
    return results


def _run_record(entry: Entry, seed: int, cfg: Any, run_dir: Path, summary: Optional[Mapping[str, Any]],
                failure: Optional[str]) -> Dict[str, Any]:
    """One run's outcome: 'finished' (with its numbers), 'incomplete' (interrupted or never started) or
    'failed' (with the one-line reason); round counts and rejected client replies in every case."""
    base: Dict[str, Any] = {"label": entry.label, "seed": seed, "run_dir": str(run_dir), "rounds": cfg.rounds,
                            "reason": failure, "metric": None}
    if summary is None:
        logged, rejected = _logged_rounds(run_dir)
        return {**base, "status": "failed" if failure else "incomplete", "rounds_completed": logged,
                "client_failures": rejected, "reason": failure or "not started"}
    complete = not summary.get("interrupted") and summary["rounds_completed"] == cfg.rounds
    if not complete:
        return {**base, "status": "incomplete", "rounds_completed": summary["rounds_completed"],
                "client_failures": int(summary.get("client_failures", 0)), "reason": "interrupted"}
    curve, seconds = _read_curve(run_dir, summary["metric"])
    return {
        **base, "status": "finished", "metric": summary["metric"],
        "final_uniform": summary["final"]["uniform"], "final_weighted": summary["final"]["weighted"],
        "best_uniform": summary["best"]["uniform"], "best_round": summary["best"]["round"],
        "final_k": summary["final"]["k"], "rounds_completed": summary["rounds_completed"],
        "bytes_up_total": summary["bytes_up_total"], "seconds": seconds,
        "client_failures": int(summary.get("client_failures", 0)), "curve": curve, **_global_finals(summary),
        **{k: v for k, v in selected_values(summary).items() if k in SELECTED_STATS},
    }


def _fmt(stat: Mapping[str, float], percent: bool) -> str:
    if stat["n"] == 0 or math.isnan(stat["mean"]):
        return "n/a"
    if percent:
        return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"
    return f"{stat['mean']:.4f} ± {stat['std']:.4f}"


def results_table(results: Mapping[str, Any]) -> Tuple[List[str], List[Dict[str, str]]]:
    """The results table's columns and rows (one per algorithm, mean ± std over seeds, percent for accuracy): what
    ``results.md`` shows and ``results.csv`` holds."""
    metric = results["metric"]
    percent = metric == "accuracy"
    unit = " (%)" if percent else ""
    selected = any("selected_uniform" in results["results"][a] for a in results["algorithms"])
    columns = ["algorithm", f"final {metric}, uniform{unit}", f"best {metric}, uniform{unit}",
               *([f"selected {metric}, uniform{unit}", f"selected {metric}, per client{unit}"] if selected else []),
               f"final {metric}, weighted{unit}", "model", "runs", "upload per run (MiB)", "seconds per run",
               "rejected"]
    rows = []
    for algo in results["algorithms"]:
        e = results["results"][algo]
        chosen = ([_fmt(e.get(k, {"n": 0}), percent) for k in ("selected_uniform", "selected_per_client")]
                  if selected else [])
        up = e["bytes_up_total"]
        sec = e.get("seconds", {"n": 0})
        planned = e.get("runs_planned", len(e["runs"]))
        runs_text = str(len(e["runs"])) if len(e["runs"]) == planned else f"{len(e['runs'])} of {planned}"
        rows.append(dict(zip(columns, [
            algo, _fmt(e["final_uniform"], percent), _fmt(e["best_uniform"], percent), *chosen,
            _fmt(e["final_weighted"], percent), e.get("model", "n/a"), runs_text,
            "n/a" if up["n"] == 0 else f"{up['mean'] / 2 ** 20:.2f}",
            "n/a" if sec["n"] == 0 else f"{sec['mean']:.1f}", str(e.get("client_failures", 0))])))
    return columns, rows


def results_markdown(results: Mapping[str, Any]) -> str:
    """The results table: one row per algorithm, mean ± std over seeds (percent for accuracy)."""
    metric = results["metric"]
    part_seed = results["partition"].get("seed")
    fixed = "" if part_seed is None else f" with partition seed {part_seed} for every run seed"
    lines = [
        f"# Comparison on {results['dataset']} ({results['partition']['name']} partition{fixed}, "
        f"{results['partition']['num_clients']} clients, {results['rounds']} rounds)",
        "",
        f"Seeds: {', '.join(map(str, results['seeds']))}. Each cell: mean ± {results['std']}. "
        f"Final = mean of the last {results['final_k']} evaluations; uniform = mean over clients of each "
        f"client's {metric}; weighted = pooled over all test samples; best = best uniform evaluation (chosen on "
        f"the test data: it overstates); selected = the test {metric} at the evaluation with the best validation "
        f"{metric} (split.val; per client: each client at its own); "
        f"seconds = training + evaluation time of a run's rounds (wall clock, {results.get('jobs', 1)} parallel "
        f"job(s)); runs = finished runs in the statistics (of those planned); rejected = client replies rejected "
        f"(NaN/Inf or an error), summed over those runs. Per-run numbers: results.json; the table as data, with "
        f"the machine and commit that computed it: results.csv.",
        "",
    ]
    columns, rows = results_table(results)
    percent = metric == "accuracy"
    unit = " (%)" if percent else ""
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    glob = [f"{algo} {_fmt(results['results'][algo]['final_global_uniform'], percent)}"
            if "final_global_uniform" in results["results"][algo] else f"{algo} none"
            for algo in results["algorithms"] if results["results"][algo]["runs"]]
    if any(not g.endswith(" none") for g in glob):
        lines += ["", f"Global model (scored on every client's test split), final {metric}, uniform{unit}: "
                      f"{'; '.join(glob)} (none: no global model)."]
    for note in results.get("notes", []):
        lines += ["", f"Note: {note}."]
    if results.get("tuning"):
        from .tuned import tuning_markdown

        lines.append(tuning_markdown(results["tuning"], results["tuning"].get("kendall_tau")))
    missing = results.get("not_in_table") or []
    if missing:
        lines += ["", f"Not in the table ({len(missing)} run(s); rows cover finished runs only):", ""]
        for run in missing:
            what = "FAILED" if run["status"] == "failed" else "incomplete"
            lines.append(f"- {run['label']}, seed {run['seed']}: {what} after {run['rounds_completed']} of "
                         f"{run['rounds']} rounds ({run['reason']}); {run['client_failures']} rejected; "
                         f"{run['run_dir']}")
        if any(r["status"] == "incomplete" for r in missing):
            lines += ["", "Rerun the same command to continue the incomplete runs (finished runs are reused)."]
    return "\n".join(lines) + "\n"


def results_data(results: Mapping[str, Any]) -> str:
    """``results.csv``: the results table as data, with its provenance (``published.PROVENANCE``: the command, and
    the machines and commits that computed the runs in it, from their ``run_info.json``)."""
    from .published import provenance_of_runs, results_csv

    columns, rows = results_table(results)
    runs = [Path(r["run_dir"]) for e in results["results"].values() for r in e["runs"]]
    part_seed = results["partition"].get("seed")
    notes = (f"{results['dataset']}, {results['partition']['name']} partition"
             f"{'' if part_seed is None else f' (partition seed {part_seed})'}, "
             f"{results['partition']['num_clients']} clients, {results['rounds']} rounds; mean ± {results['std']}; "
             f"final = mean of the last {results['final_k']} evaluations")
    if results.get("not_in_table"):
        notes += f"; {len(results['not_in_table'])} run(s) not in the table (failed or incomplete)"
    return results_csv(columns, rows, provenance_of_runs(runs, results["seeds"], notes))


def plot_curves(results: Mapping[str, Any], path: Path) -> None:
    """PNG with the uniform and weighted metric per round: one line per algorithm, std band over seeds
    (``runplot.grouped_figure``, the figure ``fl plot --group algorithm`` draws too)."""
    import matplotlib.pyplot as plt

    from .runplot import grouped_figure, save_figure

    groups = [(algo, [r["curve"] for r in results["results"][algo]["runs"]]) for algo in results["algorithms"]]
    fig = grouped_figure(groups, results["metric"], f"{results['dataset']}: mean over seeds "
                                                    f"{', '.join(map(str, results['seeds']))} (band: std)")
    try:
        save_figure(fig, Path(path))
    finally:
        plt.close(fig)
