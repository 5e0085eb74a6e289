"""``fl compare --tune N``: every compared row tuned with the same budget on validation before its seeds run.

For each row (an algorithm or a variant ``NAME+key=value``) a ``fl tune`` study of N trials runs in
``OUT/tune/<row>/`` with the row's own layers; the row is then compared twice, at its given options and at the best
trial's (a row ``<row> tuned``), each reporting the test accuracy at the validation-selected round. ``OUT/tuned.json``
records every row's best options, value and study; a rerun continues the studies (the same N adds no trial) and
reuses the finished runs. Kendall's tau between the two orders of the rows says whether tuning changes the ranking.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import ConfigError
from ..common.safefiles import write_atomic
from ..engine.config import parse_sets, resolve
from .compare import Entry, _safe_name, parse_entry
from .tuning import DEFAULT_VAL, TuneRequest, tune

TUNED_SUFFIX = " tuned"
RANK_KEY = "selected_uniform"  # the rows are ordered by their validation-selected test accuracy


def with_validation(layers: Sequence[Mapping[str, Any]], algorithm: str) -> Tuple[List[Mapping[str, Any]],
                                                                                   Optional[str]]:
    """The layers with ``split.val`` when they hold out none: the rows are tuned and selected on validation."""
    layers = list(layers)
    if resolve(layers, algorithm=algorithm).split.get("val"):
        return layers, None
    return layers + [{"split": {"val": DEFAULT_VAL}}], (
        f"split.val = {DEFAULT_VAL} for every run (--tune selects on a validation split; --set split.val=... "
        f"chooses another share)")


def tune_rows(specs: Sequence[str], layers: Sequence[Mapping[str, Any]],
              algorithm_layers: Mapping[str, Sequence[Mapping[str, Any]]], trials: int, out_dir: Path, jobs: int,
              echo: Callable[[str], None]) -> Tuple[List[Entry], Dict[str, Any]]:
    """Tune every row (``trials`` each, ``jobs`` at a time); the rows to compare -- each given row, then its tuned
    twin -- and the record written to ``OUT/tuned.json``."""
    if trials < 1:
        raise ConfigError(f"--tune {trials}: give the number of trials for each row, at least 1")
    entries = [parse_entry(s) for s in specs]
    rows: List[Entry] = []
    record: Dict[str, Any] = {"trials": trials, "rows": {}}
    for entry in entries:
        row_layers = [*layers, *algorithm_layers.get(entry.algorithm, ()),
                      *([parse_sets(entry.sets)] if entry.sets else [])]
        study_dir = Path(out_dir) / "tune" / entry.dir_name
        echo(f"tuning {entry.label}: {trials} trials -> {study_dir}")
        result = tune(TuneRequest(plugin=entry.algorithm, layers=row_layers, trials=trials, out_dir=study_dir,
                                  jobs=jobs), echo=lambda line, head=f"  {entry.label}: ": echo(head + line))
        if result.get("interrupted"):
            raise KeyboardInterrupt
        rows.append(entry)
        if "best_params" not in result:
            echo(f"  {entry.label}: no trial completed; the row is compared at its given options only")
            record["rows"][entry.label] = {"study": str(study_dir), "best": None}
            continue
        best = {k: result["best_params"][k] for k in sorted(result["best_params"])}
        sets = (*entry.sets, *(f"{k}={_text(v)}" for k, v in best.items()))
        label = entry.label + TUNED_SUFFIX
        rows.append(Entry(label=label, algorithm=entry.algorithm, sets=sets, dir_name=_safe_name(label)))
        record["rows"][entry.label] = {"study": str(study_dir), "best": best, "value": result["best_value"],
                                       "metric": result["metric"], "trial": result["best_trial"]}
    write_atomic(Path(out_dir) / "tuned.json", json.dumps(record, indent=2))
    return rows, record


def _text(value: Any) -> str:
    """A drawn option as ``--set`` text that parses back to the same value (floats in full precision)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def kendall_tau(results: Mapping[str, Any], record: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """Kendall's tau between the order of the rows at their given options and at their tuned ones, by the
    validation-selected test accuracy (mean over seeds); None with fewer than two rows tuned."""
    from .reproduce import kendall_tau as tau_a  # the one Kendall's tau of the results (tau-a)

    pairs = []
    for label, row in record["rows"].items():
        if row.get("best") is None:
            continue
        given = (results["results"].get(label) or {}).get(RANK_KEY) or {}
        tuned = (results["results"].get(label + TUNED_SUFFIX) or {}).get(RANK_KEY) or {}
        if given.get("n") and tuned.get("n") and math.isfinite(given["mean"]) and math.isfinite(tuned["mean"]):
            pairs.append((label, given["mean"], tuned["mean"]))
    if len(pairs) < 2:
        return None
    return {"tau": tau_a([p[1] for p in pairs], [p[2] for p in pairs]), "rows": [p[0] for p in pairs],
            "key": RANK_KEY}


def tuning_markdown(record: Mapping[str, Any], tau: Optional[Mapping[str, Any]]) -> str:
    """The paragraph results.md adds under the table: the budget, each row's tuned options, the rank correlation."""
    lines = ["", f"## Tuned rows (fl compare --tune {record['trials']})", "",
             f"Each row was tuned with {record['trials']} trials of `fl tune` (Optuna TPE, median pruner) on the "
             f"validation split, never on test data; `<row> tuned` runs the best trial's options. Compare the "
             f"selected columns (test accuracy at the validation-selected round).", ""]
    for label, row in record["rows"].items():
        if row.get("best") is None:
            lines.append(f"- {label}: no trial completed ({row['study']})")
        else:
            opts = ", ".join(f"{k}={_text(v)}" for k, v in row["best"].items())
            lines.append(f"- {label}: {opts} (trial {row['trial']}, {row['metric']} {row['value']:.4f}; {row['study']})")
    if tau is not None and tau["tau"] is not None:
        lines += ["", f"Kendall's tau between the rows' order at their given options and tuned, by "
                      f"{tau['key']}: {tau['tau']:.3f} over {len(tau['rows'])} rows."]
    return "\n".join(lines) + "\n"
