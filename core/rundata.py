"""Reading finished (or interrupted) run directories back: their per-round records, configuration and summary, as
the input of ``fl plot`` and ``fl export`` -- results compared without rerunning anything.

A run directory is recognised by its ``metrics.jsonl`` (one JSON object per round, written by the monitor) next to
``config.json``; ``summary.json`` is present once a run ended or was interrupted. A half-written last line (a run
killed mid-write) is skipped, as a resume does; any other unreadable line is an error naming the file and line.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, TextIO

from .errors import CheckpointError, ConfigError, did_you_mean

METRICS_NAME = "metrics.jsonl"


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
        """'finished', 'interrupted' (a summary says so, or fewer rounds than configured) or 'no summary' (still
        running, killed, or failed)."""
        if self.summary is None:
            return "no summary"
        done = self.summary.get("rounds_completed")
        if self.summary.get("interrupted") or done != self.config.get("rounds", done):
            return "interrupted"
        return "finished"

    def series(self, key: str) -> List[tuple]:
        """(round, value) for every record holding a finite ``key``."""
        out = []
        for rec in self.records:
            value = rec.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out.append((int(rec["round"]), float(value)))
        return out


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}); restore it from a copy") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is corrupt (not a JSON object); restore it from a copy")
    return data


def _read_records(path: Path) -> List[Dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__})") from None
    numbered = [(i, ln) for i, ln in enumerate(lines, start=1) if ln.strip()]
    records = []
    for pos, (lineno, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
        except ValueError:
            if pos == len(numbered) - 1:  # a run killed while writing its last line
                continue
            raise CheckpointError(f"{path} line {lineno} is not JSON; the file is damaged") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("round"), int):
            raise CheckpointError(f"{path} line {lineno} is not a round record (no integer 'round')")
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
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir() or not (path / METRICS_NAME).is_file():
        raise CheckpointError(f"{path} is not a run directory (no {METRICS_NAME}); pass the folder of one run, "
                              f"e.g. runs/fedavg-digits-20261122-123000 or a compare run OUT/runs/fedavg-seed0")
    records = _read_records(path / METRICS_NAME)
    if not records:
        raise CheckpointError(f"{path / METRICS_NAME} holds no round yet; nothing to show")
    config = _read_json(path / "config.json") or {}
    summary = _read_json(path / "summary.json")
    keys: List[str] = []
    for rec in records:
        keys.extend(k for k in rec if k not in keys)
    return RunData(path=path, label=path.name, records=records, config=config, summary=summary,
                   metric=_metric_name(summary, keys), keys=keys)


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


def _cell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "" if value is None else value


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
                 "dataset": (run.config.get("dataset") or {}).get("name"), "seed": run.config.get("seed")}
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
            "dataset": (run.config.get("dataset") or {}).get("name"), "seed": run.config.get("seed"),
            **cfg_values, "status": run.status, "rounds_logged": run.records[-1]["round"],
            "rounds": run.config.get("rounds"), "metric": run.metric,
            "final_uniform": final.get("uniform"), "final_weighted": final.get("weighted"),
            "final_k": final.get("k"), "best_uniform": best.get("uniform"), "best_round": best.get("round"),
            "best_weighted": best.get("weighted"),
            "client_failures": s.get("client_failures", sum(int(r.get("client_failures", 0)) for r in run.records)),
            "bytes_up_total": s.get("bytes_up_total"),
        })
    return rows


def write_csv(rows: Sequence[Dict[str, Any]], out: TextIO) -> List[str]:
    """Write ``rows`` as CSV with the union of their keys as columns (first-seen order); the columns."""
    columns: List[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in columns})
    return columns


def csv_text(rows: Sequence[Dict[str, Any]]) -> str:
    buf = io.StringIO()
    write_csv(rows, buf)
    return buf.getvalue()
