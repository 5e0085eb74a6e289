"""Reading finished (or interrupted) run directories back: their per-round records, configuration and summary, as
the input of ``fl plot`` and ``fl export`` -- results compared without rerunning anything.

A run directory is recognised by its ``metrics.jsonl`` (one JSON object per round, written by the monitor) next to
``config.json``; ``summary.json`` is present once a run ended or was interrupted. A half-written last line (a run
killed mid-write) is skipped, as a resume does; any other unreadable line is an error naming the file and line.

Run directories are shared, so their files are read as untrusted data: only regular files (never a link, FIFO or
device: ``safefiles.read_regular``), at most ``METRICS_LIMIT`` bytes of ``metrics.jsonl`` and ``JSON_LIMIT`` of each
JSON file, strict JSON (a duplicate key or nesting deeper than ``strictjson.MAX_DEPTH`` is refused), and the values
the commands use are type-checked. A file that breaks one of these rules stops the command with one line naming
it (exit status 2): a table or plot silently missing a run would be taken for the whole picture.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np

from ..common import strictjson
from ..common.errors import CheckpointError, ConfigError, did_you_mean
from ..common.safefiles import check_entry, read_regular, write_atomic

METRICS_NAME = "metrics.jsonl"
METRICS_LIMIT = 256 << 20   # bytes of metrics.jsonl read (about 400,000 rounds of the core's records)
JSON_LIMIT = 16 << 20       # bytes of config.json / summary.json read


@dataclass
class RunData:
    """One run directory's records (in round order), configuration and summary (None while it has none)."""

    path: Path
    label: str
    records: List[Dict[str, Any]]
    config: Dict[str, Any]
    summary: Optional[Dict[str, Any]] = None
    metric: str = "accuracy"
    keys: List[str] = field(default_factory=list)  # the record keys in first-seen order

    @property
    def status(self) -> str:
        """'finished', 'interrupted' (a summary says so, or fewer rounds than configured), 'failed' (its summary
        records a failure) or 'no summary' (still running, killed, or failed before its rounds)."""
        if self.summary is None:
            return "no summary"
        if self.summary.get("status") == "failed":  # the run failed during its rounds; summary.json says why
            return "failed"
        done = self.summary.get("rounds_completed")
        if self.summary.get("interrupted") or done != self.config.get("rounds", done):
            return "interrupted"
        return "finished"

    def series(self, key: str) -> List[tuple]:
        """(round, value) for every record holding a finite ``key`` (null, NaN, Infinity and an integer beyond float
        range count as absent: a run logs the first three when its metric diverged). A float beyond ``PLOT_LIMIT``
        in magnitude (no metric or loss of a run is that large, and it would overflow the axis range; the file is
        damaged) is a CheckpointError naming the file, round and key."""
        out = []
        for rec in self.records:
            value = rec.get(key)
            if _is_number(value):
                try:
                    value = float(value)
                except OverflowError:  # an integer beyond float range: no point of the curve, as a string is
                    continue
                if math.isfinite(value) and abs(value) > PLOT_LIMIT:
                    raise CheckpointError(f"{self.path / METRICS_NAME}: round {rec['round']} has {_shown_key(key)} = "
                                          f"{_shown_number_e(rec.get(key))}, beyond the {PLOT_LIMIT:.0e} a metric or "
                                          f"loss can be; the file is damaged, restore it from a copy")
                if math.isfinite(value):
                    out.append((rec["round"], value))
        return out


def _shown_key(key: str, limit: int = 60) -> str:
    return repr(key if len(key) <= limit else key[:limit] + "...")


def _shown_number_e(value: Any) -> str:
    """A number as a message shows it: in e-notation (an integer here is within float range)."""
    return f"{float(value):.3g}"


def _read_text(path: Path, limit: int) -> Optional[str]:
    """The text of a run file (None when absent); a link, FIFO, device, oversized or non-UTF-8 file is one line."""
    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}); the file is damaged") from None


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    text = _read_text(path, JSON_LIMIT)
    if text is None:
        return None
    try:
        data = strictjson.loads(text)
    except strictjson.StrictJSONError as exc:
        raise CheckpointError(f"{path} is refused: {exc}; restore it from a copy") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}); restore it from a copy") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is corrupt (not a JSON object); restore it from a copy")
    return data


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON object file of a run directory (None when absent), read as untrusted data as above."""
    return _read_json(Path(path))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_ROUND = 10 ** 9         # a round number beyond this is not one a run reached: the file is damaged
PLOT_LIMIT = 1e100          # |value| a plotted number may have (a larger finite one overflows an axis' range)


def _is_round(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ROUND


# summary.json: the fields the commands read and what each must be (a number may be null: not evaluated)
_SUMMARY_FIELDS = {"metric": (lambda v: isinstance(v, str) and 0 < len(v) <= 64, "a name of 1-64 characters"),
                   "rounds_completed": (_is_round, "a round number"),
                   "interrupted": (bool, "true or false"), "client_failures": (_is_number, "a number"),
                   "status": (lambda v: v in ("finished", "interrupted", "failed"), "finished, interrupted or failed"),
                   "bytes_up_total": (_is_number, "a number"), "bytes_down_total": (_is_number, "a number")}
_SUMMARY_SECTIONS = ("final", "best", "best_weighted", "last", "selected", "selected_weighted",
                     "selected_per_client")


def check_summary(path: Path, summary: Dict[str, Any]) -> Dict[str, Any]:
    """``summary`` when every field the commands read has its type; else one line naming the field."""
    def bad(key: str, value: Any, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: '{key}' is {type(value).__name__}, expected {expected}; the file is "
                               f"damaged, restore it from a copy")

    for key, (kind, expected) in _SUMMARY_FIELDS.items():
        value = summary.get(key)
        if value is not None and not (isinstance(value, kind) if isinstance(kind, type) else kind(value)):
            raise bad(key, value, expected)
    scopes = [(summary, "")]
    glob = summary.get("global")
    if glob is not None:  # the global model's numbers (core/engine/globaleval.py); null: the algorithm has none
        if not isinstance(glob, dict):
            raise bad("global", glob, "an object or null")
        scopes.append((glob, "global."))
    for scope, where in scopes:
        _check_sections(scope, where, bad)
    return summary


def _check_sections(summary: Dict[str, Any], where: str, bad: Callable[[str, Any, str], Exception]) -> None:
    for section in _SUMMARY_SECTIONS:
        values = summary.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise bad(f"{where}{section}", values, "an object")
        for key, value in values.items():
            if section == "final" and key == "per_client":  # client id -> its final metric
                if not isinstance(value, dict):
                    raise bad(f"{where}final.per_client", value, "an object")
                for cid, v in value.items():
                    if v is not None and not _is_number(v):
                        raise bad(f"final.per_client.{_short_text(cid)}", v, "a number or null")
            elif value is not None and not _is_number(value):
                raise bad(f"{where}{section}.{key}", value, "a number or null")


def read_summary(run_dir: Path) -> Optional[Dict[str, Any]]:
    """A run's ``summary.json`` (None when it has none), read and type-checked as above."""
    path = Path(run_dir) / "summary.json"
    summary = _read_json(path)
    return None if summary is None else check_summary(path, summary)


def _same_number(a: Any, b: Any) -> bool:
    """Two numbers from a summary and a re-derivation agree: both absent/non-finite, or equal to rounding."""
    a = float(a) if _is_number(a) and math.isfinite(float(a)) else None
    b = float(b) if _is_number(b) and math.isfinite(float(b)) else None
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def _shown_number(value: Any) -> str:
    return f"{value:.6g}" if _is_number(value) and math.isfinite(float(value)) else "none"


def finished_run_problem(summary: Dict[str, Any], records: Sequence[Dict[str, Any]], rounds: int,
                         final_k: int) -> Optional[str]:
    """Why ``summary`` + ``records`` (a run's ``metrics.jsonl``) are not one complete, consistent finished run of
    ``rounds`` rounds with ``eval.final_k = final_k``; None when they are.

    Complete: the summary says finished (no 'failed' status, not interrupted, ``rounds`` completed) and the log
    holds a record of every round 1..rounds. Consistent: the summary's final (mean of the last k evaluations) and
    best numbers are what the logged evaluations give, as the run computed them (``evaluation.History``). A summary
    edited by hand, or a log truncated or edited in the rounds these numbers come from, is caught here."""
    status = summary.get("status")
    if status is not None and status != "finished":
        return f"its summary says status {_short_text(status)}"
    if summary.get("interrupted"):
        return "its summary says the run was interrupted"
    if summary.get("rounds_completed") != rounds:
        return f"its summary says {summary.get('rounds_completed')!r} of {rounds} rounds completed"
    logged = {rec["round"] for rec in records}
    missing = [r for r in range(1, rounds + 1) if r not in logged]
    if missing:
        return (f"{METRICS_NAME} lacks round {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                             else "") + " (truncated?)")
    if max(logged) != rounds:
        return f"{METRICS_NAME} records round {max(logged)}, after the last round {rounds}"
    metric = summary.get("metric")
    evaluated = [rec for rec in records if rec["round"] >= 1 and f"{metric}/uniform" in rec]
    value = lambda rec, key: (float(rec[key]) if _is_number(rec.get(key)) and  # noqa: E731
                              math.isfinite(float(rec[key])) else math.nan)
    final, best = summary.get("final") or {}, summary.get("best") or {}
    k = min(int(final_k), len(evaluated))
    derived = {"evaluations": len(evaluated), "final.k": k}
    last = evaluated[len(evaluated) - k:] if k else []
    for key in ("uniform", "weighted"):
        vals = [value(rec, f"{metric}/{key}") for rec in last]
        derived[f"final.{key}"] = float(np.mean(vals)) if vals else math.nan
    uniform = [value(rec, f"{metric}/uniform") for rec in evaluated]
    if uniform:  # as History.best: the first best value (numpy stops at a first NaN, so does this)
        i = int(np.argmax(uniform) if summary.get("higher_is_better", True) is not False else np.argmin(uniform))
        derived["best.uniform"], derived["best.round"] = uniform[i], evaluated[i]["round"]
    per_client = final.get("per_client")
    if isinstance(per_client, dict):  # each client's final metric: the mean over the last k records' per_client
        values: Dict[str, List[float]] = {}
        for rec in last:
            for cid, v in (rec.get("per_client") if isinstance(rec.get("per_client"), dict) else {}).items():
                values.setdefault(str(cid), []).append(float(v) if _is_number(v) else math.nan)
        for cid in sorted(set(values) | set(map(str, per_client)), key=str):
            want = float(np.mean(values[cid])) if cid in values else math.nan
            if not _same_number(per_client.get(cid), want):
                return (f"summary.json gives final.per_client {_short_text(cid)} {_shown_number(per_client.get(cid))}"
                        f", {METRICS_NAME} gives {_shown_number(want)} (edited?)")
    stated = {"evaluations": summary.get("evaluations", len(evaluated)), "final.k": final.get("k"),
              "final.uniform": final.get("uniform"), "final.weighted": final.get("weighted"),
              "best.uniform": best.get("uniform"), "best.round": best.get("round")}
    for key, want in derived.items():
        if not _same_number(stated[key], want):
            return (f"summary.json gives {key} {_shown_number(stated[key])}, {METRICS_NAME} gives "
                    f"{_shown_number(want)} (edited?)")
    problem = _selected_problem(summary, evaluated, metric)
    if problem is not None:
        return problem
    glob = summary.get("global")
    if isinstance(glob, dict):  # the global model's numbers, from the records' global_<metric>/... values
        return _global_problem(glob, records, f"global_{metric}", int(final_k),
                               summary.get("higher_is_better", True) is not False)
    return None


def _selected_problem(summary: Dict[str, Any], evaluated: Sequence[Dict[str, Any]], metric: str,
                      where: str = "", higher: Optional[bool] = None) -> Optional[str]:
    """split.val: summary.json's selected numbers against the logged evaluations, as ``History`` chose them: the
    first evaluation with the best validation mean (uniform, weighted), and per client the first with its best
    validation metric (from the records' ``per_client`` / ``per_client_val``, when every evaluation holds them)."""
    higher = summary.get("higher_is_better", True) is not False if higher is None else higher
    better = (lambda a, b: a > b) if higher else (lambda a, b: a < b)  # noqa: E731
    value = lambda rec, key: (float(rec[key]) if _is_number(rec.get(key)) and  # noqa: E731
                              math.isfinite(float(rec[key])) else math.nan)
    checks = []
    for section, agg in (("selected", "uniform"), ("selected_weighted", "weighted")):
        stated = summary.get(section)
        if not isinstance(stated, dict):
            continue
        chosen = None
        for rec in evaluated:
            v = value(rec, f"val_{metric}/{agg}")
            if math.isfinite(v) and (chosen is None or better(v, chosen[0])):
                chosen = (v, rec)
        want = (math.nan, None) if chosen is None else (value(chosen[1], f"{metric}/{agg}"), chosen[1]["round"])
        checks += [(f"{where}{section}.{agg}", stated.get(agg), want[0]),
                   (f"{where}{section}.round", stated.get("round"), want[1])]
    per_client = summary.get("selected_per_client")
    if isinstance(per_client, dict) and evaluated and all(isinstance(rec.get("per_client_val"), dict)
                                                          and isinstance(rec.get("per_client"), dict)
                                                          for rec in evaluated):
        kept: Dict[str, Tuple[float, float]] = {}
        for rec in evaluated:
            for cid, v in rec["per_client_val"].items():
                t = rec["per_client"].get(cid)
                if _is_number(v) and _is_number(t) and math.isfinite(float(v)) and (
                        cid not in kept or better(float(v), kept[cid][0])):
                    kept[cid] = (float(v), float(t))
        checks.append(("selected_per_client.uniform", per_client.get("uniform"),
                       float(np.mean([t for _, t in kept.values()])) if kept else math.nan))
    for key, stated, want in checks:
        if not _same_number(stated, want):
            return (f"summary.json gives {key} {_shown_number(stated)}, {METRICS_NAME} gives "
                    f"{_shown_number(want)} (edited?)")
    return None


def _global_problem(glob: Dict[str, Any], records: Sequence[Dict[str, Any]], prefix: str, final_k: int,
                    higher: bool) -> Optional[str]:
    """As for the personal numbers: summary.json's ``global`` final and best against the logged evaluations."""
    evaluated = [rec for rec in records if rec["round"] >= 1 and f"{prefix}/uniform" in rec]
    value = lambda rec, key: (float(rec[key]) if _is_number(rec.get(key)) and  # noqa: E731
                              math.isfinite(float(rec[key])) else math.nan)
    k = min(final_k, len(evaluated))
    last = evaluated[len(evaluated) - k:] if k else []
    final, best = glob.get("final") or {}, glob.get("best") or {}
    checks = [("global.evaluations", glob.get("evaluations"), len(evaluated))]
    for key in ("uniform", "weighted"):
        vals = [value(rec, f"{prefix}/{key}") for rec in last]
        checks.append((f"global.final.{key}", final.get(key), float(np.mean(vals)) if vals else math.nan))
    uniform = [value(rec, f"{prefix}/uniform") for rec in evaluated]
    if uniform:
        i = int(np.argmax(uniform) if higher else np.argmin(uniform))
        checks += [("global.best.uniform", best.get("uniform"), uniform[i]),
                   ("global.best.round", best.get("round"), evaluated[i]["round"])]
    for key, stated, want in checks:
        if not _same_number(stated, want):
            return (f"summary.json gives {key} {_shown_number(stated)}, {METRICS_NAME} gives "
                    f"{_shown_number(want)} (edited?)")
    return _selected_problem(glob, evaluated, prefix, "global.", higher)


def _short_text(value: Any, limit: int = 40) -> str:
    text = str(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def read_config(run_dir: Path) -> Optional[Dict[str, Any]]:
    """A run's ``config.json`` as plain data (None when absent)."""
    return _read_json(Path(run_dir) / "config.json")


def read_records(path: Path) -> List[Dict[str, Any]]:
    """The round records of a ``metrics.jsonl``, one per round in round order ([] when the file is absent)."""
    text = _read_text(path, METRICS_LIMIT)
    return [] if text is None else _parse_records(path, text)


def _parse_records(path: Path, text: str) -> List[Dict[str, Any]]:
    numbered = [(i, ln) for i, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    records = []
    for pos, (lineno, line) in enumerate(numbered):
        try:
            rec = strictjson.loads(line)
        except strictjson.StrictJSONError as exc:
            raise CheckpointError(f"{path} line {lineno} is refused: {exc}") from None
        except ValueError:
            if pos == len(numbered) - 1:  # a run killed while writing its last line
                continue
            raise CheckpointError(f"{path} line {lineno} is not JSON; the file is damaged") from None
        if not isinstance(rec, dict) or not _is_round(rec.get("round")):
            raise CheckpointError(f"{path} line {lineno} is not a round record (no integer 'round' from 0 to "
                                  f"{MAX_ROUND:,})")
        records.append(rec)
    # a resumed run truncates its log to the checkpoint; keep the last record of a round in any case
    by_round = {rec["round"]: rec for rec in records}
    return [by_round[r] for r in sorted(by_round)]


def _metric_name(summary: Optional[Dict[str, Any]], keys: Sequence[str]) -> str:
    """The task's metric: from the summary, else the one ``<metric>/uniform`` key that is not the test loss."""
    if summary and isinstance(summary.get("metric"), str):
        return summary["metric"]
    names = [k[: -len("/uniform")] for k in keys if k.endswith("/uniform") and k != "test_loss/uniform"]
    return names[0] if names else "accuracy"


def load_run(path: Path | str) -> RunData:
    """Read one run directory; CheckpointError (one line) when it is not one or holds no round yet."""
    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{_shown(path)} does not exist") from None
    except OSError as exc:  # a name too long, a permission
        raise CheckpointError(f"{_shown(path)} cannot be read ({exc.strerror or exc})") from None
    if not path.is_dir() or not check_entry(path / METRICS_NAME):  # a link or FIFO there: refused, one line
        raise CheckpointError(f"{_shown(path)} is not a run directory (no {METRICS_NAME}); pass the folder of one "
                              f"run, e.g. runs/fedavg-digits-20261122-123000 or a compare run OUT/runs/fedavg-seed0")
    records = read_records(path / METRICS_NAME)
    if not records:
        raise CheckpointError(f"{path / METRICS_NAME} holds no round yet; nothing to show")
    config = read_config(path) or {}
    summary = read_summary(path)
    keys = list(_union_keys(records))
    return RunData(path=path, label=path.name, records=records, config=config, summary=summary,
                   metric=_metric_name(summary, keys), keys=keys)


def _shown(path: Path, limit: int = 200) -> str:
    """A path as an error message shows it: cut when longer than ``limit`` characters."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}... ({len(text)} characters)"


def _union_keys(rows: Sequence[Dict[str, Any]]) -> Dict[str, None]:
    """The keys of ``rows`` in first-seen order, in linear time (an ordered set: a dict)."""
    keys: Dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return keys


def load_runs(paths: Sequence[Path | str]) -> List[RunData]:
    """Read several run directories; labels are the folder names, with parents added where two would collide."""
    if not paths:
        raise ConfigError("name at least one run directory")
    runs = [load_run(p) for p in paths]
    if len({r.path.resolve() for r in runs}) != len(runs):
        raise ConfigError("a run directory is given twice")
    for depth in range(1, 8):  # runs/a/x and runs/b/x -> a/x, b/x
        labels = ["/".join(r.path.resolve().parts[-depth:]) for r in runs]
        if len(set(labels)) == len(labels):
            break
    for run, label in zip(runs, labels):
        run.label = label
    return runs


def _dataset_name(config: Dict[str, Any]) -> Any:
    dataset = config.get("dataset")
    return dataset.get("name") if isinstance(dataset, dict) else None


def config_value(config: Dict[str, Any], dotted: str) -> Any:
    """``train.lr`` -> config['train']['lr']; KeyError when absent."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _flat_keys(config: Dict[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k, v in config.items():
        out.extend(_flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])
    return out


# Cells a spreadsheet would run as a formula (OWASP, "CSV Injection"): text starting with one of these characters
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
# ... unless the whole text is a number ("-0.02"), which a spreadsheet reads as that number, not a formula
PLAIN_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?([eE][+-]?\d+)?")
# Columns that count things (rounds, clients, bytes, failures): written as integers, although the monitor logs every
# per-round value as a float (4.0 clients -> 4)
_COUNT_PREFIXES = ("clients_", "bytes_", "client_failures")
_COUNT_NAMES = {"round", "rounds", "rounds_logged", "best_round", "final_k", "seed", "evaluations", "num_clients"}


def is_count(column: str) -> bool:
    return column in _COUNT_NAMES or column.startswith(_COUNT_PREFIXES)


def csv_cell(column: str, value: Any) -> Any:
    """A CSV cell: numbers as numbers (counts as integers), non-finite and null as empty, lists and objects as
    JSON, and text that a spreadsheet would evaluate prefixed with ``'`` (it then shows as text)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        if value.is_integer() and is_count(column):
            return int(value)
        return value
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_START) and not PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def _config_columns(runs: Sequence[RunData], config_keys: Sequence[str]) -> List[Dict[str, Any]]:
    """Per run the requested config values; a key no run has is a typo (ConfigError with a did-you-mean)."""
    values: List[Dict[str, Any]] = [{} for _ in runs]
    for key in config_keys:
        found = False
        for run, row in zip(runs, values):
            try:
                row[key] = config_value(run.config, key)
                found = True
            except KeyError:
                row[key] = None
        if not found:
            known = sorted({k for r in runs for k in _flat_keys(r.config)})
            raise ConfigError(f"--key {key}: no run's config.json has it.{did_you_mean(key, known)}")
    return values


RUN_COLUMNS = ("run", "run_dir", "algorithm", "dataset", "seed")


def rounds_table(runs: Sequence[RunData], config_keys: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """One row per (run, round): the run's identity, the requested config values, then every per-round record
    key (the union over the runs, in first-seen order; a key a run does not log is an empty cell)."""
    extra = _config_columns(runs, config_keys)
    rows = []
    for run, cfg_values in zip(runs, extra):
        ident = {"run": run.label, "run_dir": str(run.path), "algorithm": run.config.get("algorithm"),
                 "dataset": _dataset_name(run.config), "seed": run.config.get("seed")}
        for rec in run.records:
            rows.append({**ident, **cfg_values, **rec})
    return rows


def summary_table(runs: Sequence[RunData], config_keys: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """One row per run: identity, config values, status, rounds, and the summary's final and best numbers."""
    extra = _config_columns(runs, config_keys)
    rows = []
    for run, cfg_values in zip(runs, extra):
        s = run.summary or {}
        final, best = s.get("final") or {}, s.get("best") or {}
        rows.append({
            "run": run.label, "run_dir": str(run.path), "algorithm": run.config.get("algorithm"),
            "dataset": _dataset_name(run.config), "seed": run.config.get("seed"),
            **cfg_values, "status": run.status, "rounds_logged": run.records[-1]["round"],
            "rounds": run.config.get("rounds"), "metric": run.metric,
            "final_uniform": final.get("uniform"), "final_weighted": final.get("weighted"),
            "final_k": final.get("k"), "best_uniform": best.get("uniform"), "best_round": best.get("round"),
            "best_weighted": best.get("weighted"),
            **selected_values(s),
            **_global_columns(s),
            "client_failures": s.get("client_failures", _logged_failures(run.records)),
            "bytes_up_total": s.get("bytes_up_total"),
        })
    return rows


def selected_values(summary: Dict[str, Any]) -> Dict[str, Any]:
    """split.val: the test metric at the validation-selected evaluation (uniform and weighted, each chosen on its
    own validation mean; per client, each at its own) and the rounds; {} for a run without a validation split."""
    sel, sel_w, per_client = (summary.get(k) if isinstance(summary.get(k), dict) else None
                              for k in ("selected", "selected_weighted", "selected_per_client"))
    if sel is None and sel_w is None and per_client is None:
        return {}
    return {"selected_uniform": (sel or {}).get("uniform"), "selected_round": (sel or {}).get("round"),
            "selected_weighted": (sel_w or {}).get("weighted"),
            "selected_per_client": (per_client or {}).get("uniform")}


def _global_columns(summary: Dict[str, Any]) -> Dict[str, Any]:
    """The global model's final and best numbers (summary.json's ``global``); empty cells without one."""
    glob = summary.get("global") if isinstance(summary.get("global"), dict) else {}
    final, best, best_w = (glob.get(k) if isinstance(glob.get(k), dict) else {} for k in
                           ("final", "best", "best_weighted"))
    return {"global_final_uniform": final.get("uniform"), "global_final_weighted": final.get("weighted"),
            "global_best_uniform": best.get("uniform"), "global_best_weighted": best_w.get("weighted")}


def _logged_failures(records: Sequence[Dict[str, Any]]) -> int:
    """Rejected client replies summed over the records (a run without summary); non-numbers count as 0."""
    return int(sum(r["client_failures"] for r in records if _is_number(r.get("client_failures"))
                   and math.isfinite(r["client_failures"])))


def write_csv(rows: Sequence[Dict[str, Any]], out: TextIO) -> List[str]:
    """Write ``rows`` as CSV with the union of their keys as columns (first-seen order); the columns."""
    columns = list(_union_keys(rows))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([csv_cell("", c) for c in columns])  # a header is text from the run files too
    for row in rows:
        writer.writerow([csv_cell(k, row.get(k)) for k in columns])
    return columns


def csv_text(rows: Sequence[Dict[str, Any]]) -> str:
    buf = io.StringIO()
    write_csv(rows, buf)
    return buf.getvalue()


def write_output(path: Path, data: bytes, option: str) -> None:
    """Write a table or image the user asked for: whole or not at all (a temporary file renamed over ``path``), and
    only to a regular file -- a device such as /dev/full, a FIFO or a link there is refused with one line."""
    from ..common.safefiles import RunFileError

    try:
        write_atomic(path, data)
        umask = os.umask(0)  # the temporary file was private (0600): give the result the usual permissions
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)
    except RunFileError:
        raise ConfigError(f"{option} {path}: not a regular file (a device, FIFO, link or folder); name a file to "
                          f"write") from None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None
