"""``fl tune``: an Optuna study over one algorithm's declared search ranges, each trial an ordinary pflkit run scored on
its clients' validation splits (``split.val``), never on their test splits.

- The study lives in ``OUT/study.db`` (Optuna's RDB storage on SQLite). Its identity -- the algorithm, the
  configuration, the ranges, the metric, the sampler seed -- is stored with it: the same command continues it,
  another configuration is refused. ``--trials N`` is the study's total.
- Trials run in batches of ``--jobs`` (one process each): a batch is asked from the TPE sampler, whose seed is
  derived from the study seed and the trial's number, then run, then told in trial order. The median pruner reads
  completed trials only, so the same command with the same ``--jobs`` gives the same trials, serially or not.
- A trial reports its validation metric after every evaluated round; a pruned trial's run pauses after that round
  (its directory keeps a checkpoint). A run that fails or whose metric is not finite is a failed trial, never the
  best. A tuner killed mid-batch loses only those trials' unfinished rounds: the next start marks them failed and
  runs their parameters again, resuming each run from its last checkpoint.
- Output: ``best.toml`` (the best options as a config file for ``fl run --config`` / ``fl compare --config``),
  ``trials.csv`` (one row per trial), ``history.png`` and ``importance.png`` (Optuna's matplotlib plots).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import math
import os
import shutil
import sqlite3
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..api.space import Space, parse_space, space_problem
from ..common.errors import ConfigError, PflError
from ..common.safefiles import write_atomic
from ..common.seeding import derive_seed
from ..engine.config import declared_params, deep_merge, resolve, to_plain

log = logging.getLogger(__name__)

STUDY_NAME = "pflkit"
DB_NAME = "study.db"
LOCK_NAME = "tune.lock"
TRIALS_DIR = "trials"
IDENTITY = "pflkit_identity"  # the study's user attribute holding what the study was made for
DEFAULT_VAL = 0.15  # split.val when the configuration holds out none (a study must not look at test data)
OBJECTIVES = ("best", "final")
PRUNERS = ("median", "none")


@dataclass
class TuneRequest:
    """What ``fl tune`` was asked: ``layers`` are the config file and ``--set`` layers; ``spaces`` the ``--space``
    texts by key; ``metric`` a record key (default ``val_<metric>/uniform``); ``objective`` best (the best
    evaluation of that metric: the validation-selected round) or final (the mean of the last eval.final_k)."""

    plugin: str
    layers: List[Mapping[str, Any]]
    trials: int
    out_dir: Path
    jobs: int = 1
    spaces: Dict[str, str] = field(default_factory=dict)
    metric: Optional[str] = None
    objective: str = "best"
    pruner: str = "median"
    seed: int = 0


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("fl tune needs Optuna: pip install 'pflkit[tune]' (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# -- the plan: configuration, ranges, identity --------------------------------------------------------------
def base_config(req: TuneRequest) -> Tuple[Any, List[Mapping[str, Any]], Optional[str]]:
    """The resolved configuration every trial starts from, its layers, and a note when split.val was added."""
    layers = list(req.layers)
    cfg = resolve(layers, algorithm=req.plugin)
    note = None
    if not cfg.split.get("val"):
        layers.append({"split": {"val": DEFAULT_VAL}})
        cfg = resolve(layers, algorithm=req.plugin)
        note = (f"split.val = {DEFAULT_VAL}: trials are scored on a validation split of each client's training rows "
                f"(--set split.val=... to choose another share)")
    return cfg, layers, note


def search_spaces(cfg: Any, overrides: Mapping[str, str]) -> Dict[str, Space]:
    """The ranges a study searches: those the configuration's options declare, with ``--space`` replacing,
    adding or (``off``) removing one. Keys sorted: the order Optuna asks in is part of a study's identity."""
    from ..api import registry as reg

    params = declared_params(cfg)
    spaces = {key: p.space for key, p in params.items() if p.space is not None}
    for key, space in (getattr(reg.ALGORITHMS.get(cfg.algorithm), "searches", None) or {}).items():
        if key not in params:  # a plugin's mistake, named with the plugin
            raise ConfigError(f"algorithm {cfg.algorithm} sets a search range of '{key}', which is no option of "
                              f"its configuration")
        if space is None:
            spaces.pop(key, None)
        else:
            problem = space_problem(key, space, params[key])
            if problem:
                raise ConfigError(f"algorithm {cfg.algorithm}'s search range: {problem}")
            spaces[key] = space
    for key, text in overrides.items():
        if key not in params:
            from ..common.errors import did_you_mean

            raise ConfigError(f"--space {key}: unknown option.{did_you_mean(key, params)} (fl show "
                              f"{cfg.algorithm} lists the options)")
        space = parse_space(key, text)
        if space is None:
            spaces.pop(key, None)
            continue
        problem = space_problem(key, space, params[key])
        if problem:
            raise ConfigError(f"--space {key}={text}: {problem}")
        spaces[key] = space
    if not spaces:
        raise ConfigError(f"nothing to tune: no option of {cfg.algorithm} (and no core option left) has a search range; "
                          f"give one with --space KEY=SPEC, e.g. --space train.lr=log:0.001..0.5")
    return dict(sorted(spaces.items()))


def _identity(req: TuneRequest, cfg: Any, spaces: Mapping[str, Space], metric: str) -> Dict[str, Any]:
    plain = to_plain(cfg)
    for key in ("output_dir", "run_name"):  # where the trials' runs go is the study's own business
        plain.pop(key, None)
    digest = hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()
    return {"plugin": req.plugin, "config": digest,
            "space": {k: s.text() for k, s in spaces.items()}, "metric": metric, "objective": req.objective,
            "pruner": req.pruner, "seed": req.seed}


def _nested(flat: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


# -- the study's files ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _study_lock(out_dir: Path) -> Iterator[None]:
    """One tuner per study: a second one (another terminal, a second job) is refused with one line."""
    import fcntl

    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"another fl tune is running on {out_dir} (it holds {out_dir / LOCK_NAME}); wait for "
                              f"it, or give this one another --out") from None
        yield
    finally:
        os.close(fd)


def _check_database(path: Path) -> None:
    """An existing ``study.db`` must be an Optuna study database: a damaged or foreign file is refused before
    Optuna would add its tables to it."""
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path} is not a regular file; move it away or give another --out")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"{path} cannot be read as an SQLite database ({exc}); it is damaged or not a study: "
                          f"restore it from a copy or give another --out") from None
    if not {"studies", "trials", "trial_params"} <= tables:
        raise ConfigError(f"{path} is an SQLite database but not an Optuna study; give another --out")


def _storage(url: str) -> Any:
    optuna = _optuna()
    # a batch's processes write their trials' reports at once: wait for SQLite's lock instead of failing
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})


def _pruner(name: str) -> Any:
    optuna = _optuna()
    if name == "none":
        return optuna.pruners.NopPruner()
    # the median pruner compares a trial with completed trials only: the batches stay reproducible
    # Optuna prunes at a step >= n_warmup_steps: rounds are steps 1, 2, ..., so the first round is never judged alone
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=2)


def _open_study(req: TuneRequest, url: str, identity: Dict[str, Any], higher: bool) -> Any:
    optuna = _optuna()
    path = req.out_dir / DB_NAME
    exists = path.exists() or path.is_symlink()
    if exists:
        _check_database(path)
    storage = _storage(url)
    if exists:
        try:
            study = optuna.load_study(study_name=STUDY_NAME, storage=storage, pruner=_pruner(req.pruner))
        except KeyError:
            raise ConfigError(f"{path} holds no pflkit study (an Optuna database of something else); give another "
                              f"--out") from None
        stored = study.user_attrs.get(IDENTITY)
        if stored != identity:
            differs = sorted(k for k in identity if (stored or {}).get(k) != identity[k])
            raise ConfigError(f"{req.out_dir} holds a study of another configuration (it differs in "
                              f"{', '.join(differs) or 'everything'}); rerun it with its own options or give "
                              f"another --out")
        return study
    study = optuna.create_study(study_name=STUDY_NAME, storage=storage, pruner=_pruner(req.pruner),
                                direction="maximize" if higher else "minimize")
    study.set_user_attr(IDENTITY, identity)
    return study


def _recover(study: Any) -> int:
    """Trials left running by a tuner that was killed: failed (counted as interrupted, not in the budget), their
    parameters asked again first, each resuming its run directory."""
    optuna = _optuna()
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    for t in stale:
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.set_user_attr(f"interrupted_{t.number}", True)
        study.enqueue_trial(t.params, user_attrs={"run_dir": t.user_attrs.get("run_dir"), "resumes": t.number},
                            skip_if_exists=False)
    return len(stale)


def _counted(study: Any) -> int:
    """Trials that used the budget: completed, pruned, or failed on their own (not interrupted by a killed tuner)."""
    optuna = _optuna()
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    attrs = study.user_attrs
    return sum(1 for t in study.get_trials(deepcopy=False, states=done)
               if not attrs.get(f"interrupted_{t.number}"))


# -- one trial ------------------------------------------------------------------------------------------------
@dataclass
class TrialResult:
    state: str  # complete | pruned | failed | interrupted
    value: Optional[float]
    reason: str
    seconds: float
    rounds: int


def _objective_of(records: Sequence[Mapping[str, Any]], metric: str, objective: str, final_k: int,
                  higher: bool) -> Optional[float]:
    values = [float(r[metric]) for r in records if isinstance(r.get(metric), (int, float))]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    if objective == "final":
        return float(sum(values[-final_k:]) / len(values[-final_k:]))
    return max(values) if higher else min(values)


def run_trial(url: str, trial_id: int, pruner: str, cfg: Any, run_dir: Path, metric: str, objective: str,
              higher: bool) -> TrialResult:
    """One trial's run (a fresh start, or a resume of an interrupted trial's directory), reporting ``metric`` after
    every evaluated round and pausing when the pruner says so. Runs in the tuner or in a worker process."""
    from ..engine.simulation import Simulation
    from ..storage.checkpoint import checkpoint_exists
    from ..storage.rundata import read_records, read_summary
    from .compare import _one_torch_thread, _reason, artifacts_of

    optuna = _optuna()
    study = optuna.load_study(study_name=STUDY_NAME, storage=_storage(url), pruner=_pruner(pruner))
    trial = optuna.trial.Trial(study, trial_id)
    started = time.perf_counter()
    state = {"pruned": False, "diverged": False}

    def on_round(record: Dict[str, Any]) -> bool:
        value = record.get(metric)
        if not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value):
            state["diverged"] = True
            return True
        trial.report(float(value), step=int(record["round"]))
        if int(record["round"]) < int(cfg.rounds) and trial.should_prune():  # a run that ended is complete
            state["pruned"] = True
            return True
        return False

    # a study's trials share set-up results (core.api.artifacts) through STUDY/artifacts: PCFL's flow, keyed by its
    # options and the data (the validation split included), is trained once for the trials that vary other options
    shared = artifacts_of(run_dir)
    try:
        with _one_torch_thread():
            summary = read_summary(run_dir) if run_dir.is_dir() else None
            if summary is not None and summary.get("status") == "finished":
                pass  # the tuner was killed after this run ended: its numbers are on disk
            else:
                if run_dir.is_dir() and (checkpoint_exists(run_dir) or (run_dir / "config.json").is_file()):
                    sim = Simulation.resume(run_dir, progress=False, tensorboard=False, artifacts_dir=shared)
                    for record in read_records(run_dir / "metrics.jsonl"):  # what the pruner saw before
                        if 1 <= record["round"] <= sim.completed_round and isinstance(record.get(metric), (int, float)) \
                                and math.isfinite(record[metric]):
                            trial.report(float(record[metric]), step=int(record["round"]))
                else:
                    if run_dir.exists():  # a start that left no configuration: nothing in it to keep
                        shutil.rmtree(run_dir)
                    sim = Simulation(cfg, run_dir=run_dir, progress=False, tensorboard=False,
                                     artifacts_dir=shared)
                summary = sim.run(on_round=on_round)
    except KeyboardInterrupt:
        return TrialResult("interrupted", None, "Ctrl-C", time.perf_counter() - started, 0)
    except Exception as exc:  # a failed run is a failed trial, never the best
        log.debug("tune: trial %s failed", run_dir, exc_info=exc)
        return TrialResult("failed", None, _reason(exc), time.perf_counter() - started, 0)
    seconds = time.perf_counter() - started
    rounds = int(summary.get("rounds_completed") or 0)
    if summary.get("interrupted") and not (state["pruned"] or state["diverged"]):
        return TrialResult("interrupted", None, "Ctrl-C", seconds, rounds)
    if state["diverged"]:
        return TrialResult("failed", None, f"{metric} is not finite in round {rounds}", seconds, rounds)
    if state["pruned"]:
        return TrialResult("pruned", None, f"pruned after round {rounds}", seconds, rounds)
    value = _objective_of(read_records(run_dir / "metrics.jsonl"), metric, objective, int(cfg.eval.final_k),
                          higher)
    if value is None:
        return TrialResult("failed", None, f"no finite {metric} in its records (is split.val > 0?)", seconds, rounds)
    return TrialResult("complete", value, "", seconds, rounds)


def _init_worker() -> None:
    from .compare import _init_worker as one_thread

    one_thread()


# -- the tuner ------------------------------------------------------------------------------------------------
def tune(req: TuneRequest, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run (or continue) the study of ``req``; its summary (best value and options, counts, files)."""
    optuna = _optuna()
    if req.trials < 1:
        raise ConfigError(f"--trials {req.trials}: give the study's total number of trials, at least 1")
    if req.jobs < 1:
        raise ConfigError(f"--jobs {req.jobs}: must be at least 1")
    if req.objective not in OBJECTIVES or req.pruner not in PRUNERS:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, --pruner one of {', '.join(PRUNERS)}")
    cfg, layers, note = base_config(req)
    spaces = search_spaces(cfg, req.spaces)
    for key in spaces:  # every drawn value must be a valid setting: check both ends of each range now
        for value in spaces[key].values_to_check():
            resolve(layers + [_nested({key: value})], algorithm=req.plugin)
    from ..data.data import load_dataset

    task = load_dataset(cfg).task
    metric = req.metric or f"val_{task.metric_name}/uniform"
    if not metric.startswith("val_"):
        raise ConfigError(f"--metric {metric}: a study optimises a validation metric (val_...), never the test "
                          f"data's; e.g. val_{task.metric_name}/uniform or val_{task.metric_name}/weighted")
    higher = bool(task.higher_is_better)
    out_dir = Path(req.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    if note:
        echo(note)
    url = f"sqlite:///{(out_dir / DB_NAME).resolve()}"
    req.out_dir = out_dir
    with _study_lock(out_dir):
        study = _open_study(req, url, _identity(req, cfg, spaces, metric), higher)
        recovered = _recover(study)
        if recovered:
            echo(f"{recovered} trial(s) interrupted earlier: their parameters run again, each resuming its run")
        already = _counted(study)
        echo(f"tuning {req.plugin} on {cfg.dataset.name}: {', '.join(f'{k} {s.text()}' for k, s in spaces.items())};"
             f" {metric} ({req.objective} evaluation), {'higher' if higher else 'lower'} is better; "
             f"{already} of {req.trials} trials done -> {out_dir}")
        interrupted = _run_batches(study, req, layers, spaces, url, metric, higher, echo)
        result = write_outputs(study, req, layers, spaces, metric)
    result["interrupted"] = interrupted
    return result


def _ask(study: Any, req: TuneRequest, layers: List[Mapping[str, Any]], spaces: Mapping[str, Space]
         ) -> Tuple[Any, Optional[Any], Path, Optional[str]]:
    """The next trial: its sampler seeded from the study seed and its number (so a study is reproducible however
    often the tuner was restarted), its options drawn, its configuration resolved."""
    optuna = _optuna()
    number = len(study.get_trials(deepcopy=False))
    study.sampler = optuna.samplers.TPESampler(seed=derive_seed(req.seed, "tune", number) % 2 ** 32)
    trial = study.ask()
    params = {key: space.suggest(trial, key) for key, space in spaces.items()}
    run_dir = Path(trial.user_attrs.get("run_dir") or req.out_dir / TRIALS_DIR / f"trial-{trial.number:04d}")
    trial.set_user_attr("run_dir", str(run_dir))
    try:
        cfg = resolve(layers + [_nested(params), {"output_dir": str(run_dir.parent), "run_name": run_dir.name}],
                      algorithm=req.plugin)
    except ConfigError as exc:  # a combination the options refuse together: a failed trial, never the best
        return trial, None, run_dir, str(exc)
    return trial, cfg, run_dir, None


def _run_batches(study: Any, req: TuneRequest, layers: List[Mapping[str, Any]], spaces: Mapping[str, Space],
                 url: str, metric: str, higher: bool, echo: Callable[[str], None]) -> bool:
    optuna = _optuna()
    pool = ProcessPoolExecutor(max_workers=req.jobs, initializer=_init_worker) if req.jobs > 1 else None
    try:
        while True:
            left = req.trials - _counted(study)
            if left <= 0:
                return False
            batch = [_ask(study, req, layers, spaces) for _ in range(min(req.jobs, left))]
            args = [(url, trial._trial_id, req.pruner, cfg, run_dir, metric, req.objective, higher)
                    for trial, cfg, run_dir, _ in batch]
            results: List[TrialResult] = []
            try:
                if pool is None:
                    results = [run_trial(*a) if batch[i][1] is not None else None for i, a in enumerate(args)]
                else:
                    futures = [pool.submit(run_trial, *a) if batch[i][1] is not None else None
                               for i, a in enumerate(args)]
                    results = [f.result() if f is not None else None for f in futures]
            except KeyboardInterrupt:
                echo("interrupted: the trials in flight stay to be resumed; rerun the same command to continue")
                return True
            stop = False
            for (trial, cfg, run_dir, refused), res in zip(batch, results):
                if res is None:
                    res = TrialResult("failed", None, refused or "refused", 0.0, 0)
                if res.state == "interrupted":
                    stop = True  # left running: the next start resumes it
                    continue
                trial.set_user_attr("seconds", round(res.seconds, 3))
                trial.set_user_attr("rounds", res.rounds)
                if res.reason:
                    trial.set_user_attr("reason", res.reason)
                state = {"complete": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED,
                         "failed": optuna.trial.TrialState.FAIL}[res.state]
                if res.state == "complete":
                    study.tell(trial, res.value)
                else:
                    study.tell(trial, state=state)
                shown = f"{res.value:.4f}" if res.value is not None else res.reason
                echo(f"[{_counted(study)}/{req.trials}] trial {trial.number}: {res.state}, {shown} "
                     f"({', '.join(f'{k}={_short(v)}' for k, v in trial.params.items())}; {res.seconds:.1f} s)")
            if stop:
                echo("interrupted: rerun the same command to continue (the runs resume from their checkpoints)")
                return True
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# -- outputs --------------------------------------------------------------------------------------------------
def write_outputs(study: Any, req: TuneRequest, layers: List[Mapping[str, Any]], spaces: Mapping[str, Space],
                  metric: str) -> Dict[str, Any]:
    """``trials.csv``, ``best.toml`` and the plots; the study's summary."""
    optuna = _optuna()
    out_dir = Path(req.out_dir)
    trials = study.get_trials(deepcopy=False)
    attrs = study.user_attrs
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    keys = list(spaces)
    writer.writerow(["trial", "state", metric, *keys, "rounds", "seconds", "run_dir", "reason"])
    for t in trials:
        state = "interrupted" if attrs.get(f"interrupted_{t.number}") else t.state.name.lower()
        value = t.value if t.state == optuna.trial.TrialState.COMPLETE else None
        writer.writerow([t.number, state, "" if value is None else repr(value),
                         *[t.params.get(k, "") for k in keys], t.user_attrs.get("rounds", ""),
                         t.user_attrs.get("seconds", ""), t.user_attrs.get("run_dir", ""),
                         t.user_attrs.get("reason", "")])
    write_atomic(out_dir / "trials.csv", buf.getvalue())
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    result: Dict[str, Any] = {"out_dir": str(out_dir), "trials": len(trials), "complete": len(complete),
                              "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
                              "failed": sum(t.state == optuna.trial.TrialState.FAIL for t in trials),
                              "metric": metric, "files": ["trials.csv"]}
    if complete:
        best = study.best_trial
        best_layer = _nested({k: best.params[k] for k in keys})
        doc = deep_merge({}, {"algorithm": req.plugin})
        for layer in layers:
            doc = deep_merge(doc, layer)
        doc = deep_merge(doc, best_layer)
        doc.pop("output_dir", None)
        doc.pop("run_name", None)
        header = (f"# fl tune: trial {best.number} of {len(trials)}, {metric} {best.value!r} "
                  f"({req.objective} evaluation); run it with: fl run --config best.toml\n")
        write_atomic(out_dir / "best.toml", header + to_toml(to_plain(doc)))
        result.update({"best_trial": best.number, "best_value": best.value, "best_params": dict(best.params),
                       "best_run_dir": best.user_attrs.get("run_dir")})
        result["files"].append("best.toml")
        result["files"] += _plots(study, out_dir, len(complete))
    return result


def _plots(study: Any, out_dir: Path, complete: int) -> List[str]:
    """The optimisation history, and the parameters' importances once there are enough trials to estimate them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    written = []
    for name, draw, needed in (("history.png", ovm.plot_optimization_history, 1),
                               ("importance.png", ovm.plot_param_importances, 2)):
        if complete < needed or (name == "importance.png" and len(study.best_trial.params) < 2):
            continue
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                ax = draw(study)
            fig = ax.figure if hasattr(ax, "figure") else plt.gcf()
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            written.append(name)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. every trial drew the same values
            log.warning("tune: %s not drawn: %s", name, exc)
    return written


def to_toml(doc: Mapping[str, Any]) -> str:
    """A configuration (plain data: sections of numbers, strings, booleans and lists of them) as TOML."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string is a JSON string
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise PflError(f"best.toml: cannot write a {type(v).__name__}")

    def section(prefix: str, node: Mapping[str, Any]) -> List[str]:
        lines = [f"{k} = {value(v)}" for k, v in node.items() if v is not None and not isinstance(v, Mapping)]
        for k, v in node.items():
            if isinstance(v, Mapping):
                name = f"{prefix}{k}"
                inner = section(f"{name}.", v)
                if inner:
                    lines += ["", f"[{name}]", *inner] if any(not isinstance(x, Mapping) for x in v.values()) \
                        else inner
        return lines

    return "\n".join(section("", doc)).lstrip("\n") + "\n"
