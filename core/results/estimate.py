"""How long a comparison (``fl reproduce``'s cells) will take, from measured first rounds, said before it runs.

Rows cost very different times (a set-up that trains a flow, a local-only method), and so do a table's settings
(dataset, model): one measured run per row and setting, ``seeds`` of each then cost the same. The measured run is
one the comparison would make anyway -- its first seed, in its own run directory, with the same configuration --
paused after its first rounds with a checkpoint (``Simulation.run(stop_after=...)``), so ``run_comparison`` resumes
it: measuring costs nothing but a second start. Round 1 is slower than the rest (first-call set-up in torch and the
trainer), so two rounds are measured where the run has three or more: the second round's time is the rate, and
what came before it -- data, set-up, round 1's extra -- a fixed cost per run.

A run that exists already is not measured again: a finished one costs nothing more; a paused one (``resume``)
costs its remaining rounds at the rate this module recorded when it measured it (``OUT/timing.json``), else at the
rate its ``metrics.jsonl`` logs; a finished run made in one go also gives the fixed cost (its wall-clock time from
``run_info.json``'s start to ``summary.json``, less its logged rounds), so a table extended by more seeds counts
each new run's set-up.
"""
from __future__ import annotations

import json
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import CheckpointError
from ..common.safefiles import write_atomic
from ..storage.monitor import duration, evaluations_after
from ..storage.rundata import read_json, read_records
from .compare import _existing_run, _init_worker, _one_torch_thread, _plan

TIMING_NAME = "timing.json"  # per comparison folder: the measured rate of each run measured there


@dataclass(frozen=True)
class Timing:
    """A run's cost: ``fixed`` seconds once (data, set-up, round 1's extra), ``train`` a round, ``eval`` an
    evaluation."""

    fixed: float
    train: float
    eval: float

    def run_seconds(self, rounds: int, eval_every: int, from_round: int = 0) -> float:
        """Seconds of rounds ``from_round`` + 1 .. ``rounds`` (the fixed cost only for a run that starts at 0)."""
        left = max(0, rounds - from_round)
        evals = evaluations_after(from_round, rounds, eval_every)
        return (self.fixed if from_round == 0 else 0.0) + left * self.train + evals * self.eval


def measured_rounds(rounds: int) -> int:
    """Rounds a measurement runs: two (the second is the rate) where the run has three or more, else one."""
    return 2 if rounds >= 3 else 1


def timing_from_records(records: Sequence[Mapping[str, Any]], wall: Optional[float] = None) -> Optional[Timing]:
    """A run's rate from its logged rounds: the last logged round's training time, the mean evaluation time; with
    ``wall`` (the seconds the logged rounds took from the start, set-up included) the rest is the fixed cost."""
    rounds = [r for r in records if _number(r.get("round_seconds")) is not None]
    if not rounds:
        return None
    train = _number(rounds[-1]["round_seconds"])
    evals = [e for e in (_number(r.get("eval_seconds")) for r in rounds) if e is not None]
    ev = sum(evals) / len(evals) if evals else 0.0
    fixed = 0.0 if wall is None else max(0.0, wall - len(rounds) * train - len(evals) * ev)
    return Timing(fixed=fixed, train=train, eval=ev)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


class SetupLines:
    """Where a measured run's set-up lines go: ``echo`` with the run named in front; without one (a worker
    process), stdout, flushed at once. Picklable, so worker processes get it too."""

    def __init__(self, name: str, echo: Optional[Callable[[str], None]] = None):
        self.name, self.echo = name, echo

    def __call__(self, line: str) -> None:
        text = f"measuring {self.name}: {line}"
        if self.echo is not None:
            self.echo(text)
        else:
            print(text, flush=True)


def measure_run(cfg: Any, run_dir: Path, on_setup: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Start the run ``cfg`` in ``run_dir`` and pause it after :func:`measured_rounds` rounds with a checkpoint (the
    comparison resumes it); its Timing as a dict (``seconds``: what measuring took, set-up included), or the
    one-line reason it failed (the comparison then reruns it and reports the failure). ``on_setup`` receives the
    run's set-up lines as they happen (a set-up can take minutes)."""
    from ..engine.simulation import Simulation
    from .compare import _reason, artifacts_of

    started = time.perf_counter()
    wanted = measured_rounds(int(cfg.rounds))
    try:
        with _one_torch_thread():  # the comparison's runs use one torch thread: so does their measurement
            # it shares the comparison's set-up results (OUT/artifacts) like the runs it stands for: it may be the one
            # that makes a result (PCFL's flow) the others load, or load one another made
            summary = Simulation(cfg, run_dir=run_dir, progress=False, artifacts_dir=artifacts_of(Path(run_dir))) \
                .run(stop_after=wanted, on_setup=on_setup)
    except Exception as exc:  # a plugin's bug or a bad setting: the comparison runs it again and reports it
        return {"failed": _reason(exc)}
    if summary.get("rounds_completed", 0) < wanted:  # Ctrl-C paused it earlier (checkpointed): stop here too
        raise KeyboardInterrupt
    if summary.get("rounds_completed") == int(cfg.rounds) and not summary.get("interrupted"):
        from .compare import record_verified  # a run short enough to finish while measured: verified as compare's

        record_verified(Path(run_dir))
    spent = time.perf_counter() - started
    timing = timing_from_records(read_records(Path(run_dir) / "metrics.jsonl"), spent)
    return {"failed": "no round logged"} if timing is None else {**asdict(timing), "seconds": spent}


def _read_timings(folder: Path) -> Dict[str, Timing]:
    try:
        data = read_json(folder / TIMING_NAME) or {}
    except CheckpointError:
        return {}
    out = {}
    for name, t in (data.get("runs") or {}).items() if isinstance(data, dict) else ():
        if isinstance(t, dict) and all(_number(t.get(k)) is not None for k in ("fixed", "train", "eval")):
            out[str(name)] = Timing(float(t["fixed"]), float(t["train"]), float(t["eval"]))
    return out


@dataclass
class Estimate:
    runs: int = 0            # runs of the selection
    finished: int = 0        # finished earlier: nothing left to do
    measured: int = 0        # measured now (paused, resumed by the comparison)
    unknown: int = 0         # runs of a row and setting that could not be timed (their measurement failed)
    seconds: float = 0.0     # run time left, summed over runs
    longest: float = 0.0     # the longest single run left (a lower bound on the wall time with many jobs)
    measuring: float = 0.0   # seconds the measurements took now (set-up included), summed over measured runs
    fixed: float = 0.0       # the largest fixed cost (data, set-up, round 1's extra) of a run still to start

    def add(self, seconds: float, fixed: float = 0.0) -> None:
        self.seconds += seconds
        self.longest = max(self.longest, seconds)
        self.fixed = max(self.fixed, fixed)

    def wall(self, jobs: int) -> float:
        return max(self.seconds / max(1, jobs), self.longest)


def estimate_comparisons(settings: Sequence[Tuple[Path, Mapping[str, Any]]], specs: Sequence[str],
                         seeds: Sequence[int], jobs: int = 1,
                         echo: Optional[Callable[[str], None]] = None) -> Estimate:
    """Estimate the run time left of one comparison per (folder, config layer) of ``specs`` x ``seeds``, measuring
    one run per spec and setting that has no timed run yet (``jobs`` at a time). Raises what ``run_comparison``
    would raise for a bad plan or a run directory it would refuse, before anything is measured."""
    est = Estimate()
    # cells: (folder, entry label) -> the planned runs [(run_dir, cfg, state)]
    cells: Dict[Tuple[Path, str], List[Tuple[Path, Any, Optional[str]]]] = {}
    for folder, layer in settings:
        _, plan = _plan(list(specs), [int(s) for s in seeds], [layer], {})
        for (entry, seed), cfg in plan.items():
            run_dir = Path(folder) / "runs" / f"{entry.dir_name}-seed{seed}"
            state, _ = _existing_run(run_dir, cfg)
            cells.setdefault((Path(folder), entry.label), []).append((run_dir, cfg, state))
    timings = {folder: _read_timings(folder) for folder, _ in settings}
    to_measure: List[Tuple[Path, str, Path, Any]] = []
    known: Dict[Tuple[Path, str], Timing] = {}
    for (folder, label), runs in cells.items():
        timed = next((timings[folder][d.name] for d, _, s in runs if s == "resume" and d.name in timings[folder]),
                     None)
        for run_dir, _, state in runs:
            if timed is None and state in ("finished", "resume"):
                wall = _finished_wall(run_dir) if state == "finished" else None
                timed = timing_from_records(read_records(run_dir / "metrics.jsonl"), wall)
        if timed is not None:
            known[folder, label] = timed
            continue
        if any(s == "resume" for _, _, s in runs):
            # a run of this row is under way, paused before its first round: measuring another would start a second
            # set-up beside it (PCFL's flow: hours, made once for every seed); it is timed once its rounds are logged
            continue
        fresh = next(((d, c) for d, c, s in runs if s is None), None)
        if fresh is not None:
            to_measure.append((folder, label, *fresh))
    if to_measure and echo is not None:
        echo(f"estimating the run time: {measured_rounds(int(to_measure[0][3].rounds))} round(s) of "
             f"{len(to_measure)} run(s), one per row and setting, which then continue")
    results = _measure_all([(cfg, run_dir, f"{folder.name}/{run_dir.name}") for folder, _, run_dir, cfg in to_measure],
                           jobs, echo)
    measured_now: Dict[Path, Dict[str, Any]] = {}
    for (folder, label, run_dir, cfg), result in zip(to_measure, results):
        if "failed" in result:
            continue
        known[folder, label] = Timing(result["fixed"], result["train"], result["eval"])
        measured_now.setdefault(folder, {})[run_dir.name] = {k: result[k] for k in ("fixed", "train", "eval")}
        est.measured += 1
        est.measuring += result.get("seconds", 0.0)
    for folder, new in measured_now.items():
        saved = {k: asdict(v) for k, v in timings[folder].items()}
        saved.update(new)
        write_atomic(folder / TIMING_NAME, json.dumps({"runs": saved}, indent=2))
    for (folder, label), runs in cells.items():
        timing = known.get((folder, label))
        for run_dir, cfg, state in runs:
            est.runs += 1
            if state == "finished":
                est.finished += 1
                continue
            measured = state == "resume" or run_dir.name in measured_now.get(folder, {})
            if timing is None:
                est.unknown += 1
                continue
            done = _logged_round(run_dir) if measured else 0
            est.add(timing.run_seconds(int(cfg.rounds), int(cfg.eval.every), done), timing.fixed if done == 0 else 0.0)
    return est


def _finished_wall(run_dir: Path) -> Optional[float]:
    """The wall-clock seconds of a finished run made in one go (set-up included): from its start in
    ``run_info.json`` to its ``summary.json``, written as it ended. None for a resumed run (its pauses are not run
    time) or without those records."""
    from datetime import datetime

    from ..storage.runinfo import read

    entries = read(run_dir)
    if len(entries) != 1 or entries[0].get("event") != "start" or (run_dir / "resumes.jsonl").exists():
        return None
    try:
        start = datetime.fromisoformat(str(entries[0]["time"])).timestamp()
        end = (run_dir / "summary.json").stat().st_mtime
    except (KeyError, ValueError, OSError):
        return None
    return end - start if end >= start else None


def _logged_round(run_dir: Path) -> int:
    try:
        rows = read_records(run_dir / "metrics.jsonl")
    except CheckpointError:
        return 0
    return max((int(r["round"]) for r in rows if isinstance(r.get("round"), int)), default=0)


def _measure_all(tasks: Sequence[Tuple[Any, Path, str]], jobs: int,
                 echo: Optional[Callable[[str], None]]) -> List[Dict[str, Any]]:
    """Measure each (cfg, run_dir, name); set-up lines go to ``echo`` (worker processes: to stdout)."""
    if jobs == 1 or len(tasks) <= 1:
        return [measure_run(cfg, run_dir, SetupLines(name, echo) if echo is not None else None)
                for cfg, run_dir, name in tasks]
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), initializer=_init_worker) as pool:
        return list(pool.map(measure_run, [c for c, _, _ in tasks], [d for _, d, _ in tasks],
                             [SetupLines(n) if echo is not None else None for _, _, n in tasks]))


def estimate_line(est: Estimate, what: str, jobs: int, unit: str = "CPU") -> str:
    """One line: the runs, how many are left, the estimated wall time with ``jobs``, the resource-hours of the runs
    left (``unit``: CPU = one core per run, GPU = one GPU per run; what a cluster's job array is sized by) and how it
    was measured."""
    left = est.runs - est.finished
    head = f"estimate for {what}: {est.runs} run(s), {est.finished} finished earlier, {left} to run"
    if left == 0:
        return head + ": nothing to run"
    total = f"about {duration(est.wall(jobs))} with --jobs {jobs}"
    total += f" ({est.seconds / 3600:.1f} {unit}-hours of run time in all, one {'core' if unit == 'CPU' else unit} a run"
    total += f"; {duration(est.wall(1))} one at a time)" if jobs > 1 else ")"
    how = (f"measured now from {est.measured} paused run(s) that continue (measuring took "
           f"{duration(est.measuring)}, set-up included)" if est.measured
           else "from the rounds already logged")
    fixed = (f"; each run not started yet counts its set-up and first-round warm-up (up to {duration(est.fixed)})"
             if est.fixed >= 1.0 else "")
    unknown = f"; {est.unknown} run(s) not timed (their measurement failed), not counted" if est.unknown else ""
    return f"{head}: {total}, {how}{fixed}{unknown}"

