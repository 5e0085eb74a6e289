"""Run a paper's table (``pflkit.core.results.tables``) through ``run_comparison`` and set pflkit's numbers beside
the paper's.

One comparison per column (``OUT/<column id>/``: resumable, ``jobs``), every row of the table an entry of it, labelled
by the row id. ``results.md`` and ``results.csv`` hold per cell the paper's number, pflkit's mean and std over seeds,
the difference, and whether pflkit's mean lies within the paper's spread (paper mean +- paper std); and per column
the rows ranked both ways (Kendall's tau between the two orders, and whether the winner is the same). At
``quick`` scale every output file and section says so: those numbers are not the paper's setting.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..api import registry as reg
from ..common.errors import ConfigError, DataError, PflError
from ..data.data import dataset_root, load_dataset
from ..data.datasources import sources_of
from ..engine.config import deep_merge, parse_sets, resolve
from ..storage.rundata import read_records, read_summary
from .compare import parse_entry, run_comparison
from .tables import Column, Row, Table
from .tuned import TUNED_SUFFIX

from .labels import NEUTRAL_SET_KEYS, QUICK_LABEL  # noqa: F401  (re-exported: tests and docs read them here)


def scale_label(quick: bool, sets: Sequence[str] = ()) -> str:
    """What every output file and section is labelled with when the cells are not the paper's setting ('' when they are)."""
    changing = [s for s in sets if s.partition("=")[0].strip() not in NEUTRAL_SET_KEYS]
    if not changing:
        return QUICK_LABEL if quick else ""
    return f"{'quick scale' if quick else 'paper scale'} with --set {' '.join(changing)}, not the paper's setting"


def _cell_layer(table: Table, column: Column, quick: bool, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """A column's config layer, with the command line's ``--set`` overrides on top (every cell alike)."""
    return deep_merge(table.layer(column, quick), dict(overrides)) if overrides else table.layer(column, quick)


def _row_spec(row: Row, overrides: Mapping[str, Any], quick: bool = False) -> str:
    """The row's ``fl compare`` entry with the ``--set`` overrides of the options it sets itself: an entry's own
    settings win over the shared layers, so without this a row's option would silently beat ``--set``."""
    def own(opts: Mapping[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
        out = {}
        for key, value in over.items():
            if key in opts:
                both = isinstance(opts[key], Mapping) and isinstance(value, Mapping)
                out[key] = own(opts[key], value) if both else value
        return out

    options = row.options_at(quick)
    mine = own(options, overrides)
    return dataclasses.replace(row, options=deep_merge(options, mine), quick=None).spec()


def _select(what: str, wanted: Optional[Sequence[str]], have: Sequence[str]) -> List[str]:
    if not wanted:
        return list(have)
    for w in wanted:
        if w not in have:
            from ..common.errors import did_you_mean

            raise ConfigError(f"--{what}: no {what[:-1]} '{w}' in this table.{did_you_mean(w, have)} "
                              f"Available: {', '.join(have)}")
    return list(wanted)


def data_status(cfg: Any, load: bool) -> Tuple[Optional[bool], str]:
    """(present, words; present None: not checked) for a resolved config's dataset. A dataset a registry package provides is present when its
    files are in ``dataset.root`` (the core's rule, ``dataset_root``); its absence names the ``fl data install``
    command. Any other dataset is checked by loading it when ``load`` (its loader names the files to place), and
    reported as not checked otherwise."""
    name = cfg.dataset.name
    root = cfg.dataset.get("root")
    loader = reg.DATASETS.get(name)
    sources = sources_of(loader)
    base = dataset_root(root)
    if sources:
        found = next((src.present_in(base) for src in sources if src.present_in(base)), None)
        if found:
            return True, f"present in {found}"
        if load:  # the loader may read the original release's files instead (MNIST's idx files under MNIST/raw)
            try:
                load_dataset(cfg)
                return True, "loads"
            except DataError:
                pass
        hint = f" --root {root}" if root not in (None, "") else ""
        return False, f"dataset {name} absent from {base}: fl data install {name}{hint}"
    if not load:
        return None, "no registry package: not checked here, checked by loading it before a run"
    try:
        load_dataset(cfg)
    except DataError as exc:
        return False, str(exc).splitlines()[0]
    return True, "loads"


def _column_cfg(table: Table, column: Column, quick: bool, overrides: Mapping[str, Any] = {},
                row: Optional[Row] = None) -> Any:
    """A column's config as one row resolves it (the first row by default): its dataset is every row's."""
    entry = parse_entry((row or table.rows[0]).spec(quick))
    return resolve([_cell_layer(table, column, quick, overrides), parse_sets(entry.sets), {"seed": 0}],
                   algorithm=entry.algorithm)


def list_lines(tables: Sequence[Table]) -> List[str]:
    out = []
    for t in tables:
        out.append(f"{t.name}: {t.title()} -- {len(t.rows)} rows, {len(t.columns)} columns")
        for column in t.columns:
            try:
                cfg = _column_cfg(t, column, False)
                present, words = data_status(cfg, load=False)
                state = "unchecked" if present is None else "present" if present else "MISSING"
                words = words.replace(f"dataset {cfg.dataset.name} ", "")
                out.append(f"  {column.id} ({column.label}): dataset {cfg.dataset.name}, {state} ({words})")
            except PflError as exc:
                out.append(f"  {column.id} ({column.label}): cannot resolve its config ({exc})")
    return out


def missing_data(table: Table, columns: Sequence[Column], quick: bool,
                 overrides: Mapping[str, Any] = {}, row: Optional[Row] = None) -> List[str]:
    """One line per selected column whose dataset is not there, naming the command or the files to place. Columns
    of one dataset setting (e.g. a table's per-domain columns) load it once. ``row``: a selected row, which
    resolves the cells' config (``overrides`` may name options only it has)."""
    out = []
    checked: Dict[str, Tuple[Optional[bool], str]] = {}
    for column in columns:
        cfg = _column_cfg(table, column, quick, overrides, row)
        key = json.dumps(cfg.dataset, sort_keys=True, default=str)
        if key not in checked:
            checked[key] = data_status(cfg, load=True)
        present, words = checked[key]
        if not present:
            out.append(f"column {column.id}: {words}")
    return out


# summary.json's place of each pflkit metric key read from the summary: (section, part, value); section None: top level
_SUMMARY_KEYS = {"best_weighted": (None, "best_weighted", "weighted"),
                 "selected_uniform": (None, "selected", "uniform"),
                 "selected_weighted": (None, "selected_weighted", "weighted"),
                 "selected_per_client": (None, "selected_per_client", "uniform"),
                 "final_global_uniform": ("global", "final", "uniform"),
                 "final_global_weighted": ("global", "final", "weighted"),
                 "best_global_uniform": ("global", "best", "uniform"),
                 "best_global_weighted": ("global", "best_weighted", "weighted")}
NO_GLOBAL_MODEL = "no global model"
SELECTED_CLIENTS = "selected_clients"  # --tune, a per-client column: each client's test metric at its best validation


def _run_value(run: Mapping[str, Any], key: str, clients: Optional[Sequence[int]] = None) -> Optional[float]:
    """One finished run's value of a pflkit metric key (``tables.PFLKIT_METRICS``); ``clients`` for final_clients.
    None where the run lacks it (a client it did not evaluate, more clients than per-client values are kept, or no
    global model: :func:`_no_value_reason` says which)."""
    if key in ("final_uniform", "final_weighted", "best_uniform"):
        return run.get(key)
    if key in _SUMMARY_KEYS:
        section, part, name = _SUMMARY_KEYS[key]
        summary = read_summary(Path(run["run_dir"])) or {}
        scope = summary.get(section) if section else summary
        value = ((scope or {}).get(part) or {}).get(name) if isinstance(scope, Mapping) else None
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    if key == SELECTED_CLIENTS:
        return _selected_clients(Path(run["run_dir"]), clients or ())
    if key == "final_clients":
        summary = read_summary(Path(run["run_dir"])) or {}
        per_client = (summary.get("final") or {}).get("per_client") or {}
        values = [per_client.get(str(c)) for c in clients or ()]
        if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            return None
        return sum(values) / len(values)
    stat = key.split("_", 1)[1]  # min / max over clients, mean of the last final_k evaluations
    rows = [r for r in read_records(Path(run["run_dir"]) / "metrics.jsonl")
            if isinstance(r.get(f"{run['metric']}/{stat}"), (int, float))]
    last = rows[-int(run["final_k"]):]
    return sum(r[f"{run['metric']}/{stat}"] for r in last) / len(last) if last else None


def _selected_clients(run_dir: Path, clients: Sequence[int]) -> Optional[float]:
    """The mean over ``clients`` of each one's test metric at its own best validation evaluation (early stopping of
    its personal model, as the run's ``selected_per_client``; the first of equal values), from ``metrics.jsonl``'s
    ``per_client`` and ``per_client_val``; None when a client has no validation value."""
    summary = read_summary(run_dir) or {}
    higher = summary.get("higher_is_better", True) is not False
    rows = read_records(run_dir / "metrics.jsonl")
    values = []
    for cid in clients:
        best = None
        for row in rows:
            val = (row.get("per_client_val") or {}).get(str(cid))
            test = (row.get("per_client") or {}).get(str(cid))
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (val, test)):
                continue
            if best is None or (val > best[0] if higher else val < best[0]):
                best = (val, test)
        if best is None:
            return None
        values.append(best[1])
    return sum(values) / len(values) if values else None


def _tuned_metric(metric: Mapping[str, Any]) -> Dict[str, Any]:
    """The metric a tuned row is read with: the test metric at the evaluation chosen on validation -- the pooled
    one for a weighted column, each named client's own for a per-client column, else the uniform mean's."""
    key = metric["pflkit"]
    chosen = "selected_weighted" if "weighted" in key else SELECTED_CLIENTS if key == "final_clients" else \
        "selected_uniform"
    return {**metric, "pflkit": chosen}


def _no_value_reason(run: Mapping[str, Any], key: str) -> str:
    """Why a finished run has no value of ``key``: the cell's text where no run of it has one."""
    if key in _SUMMARY_KEYS and _SUMMARY_KEYS[key][0] == "global":
        summary = read_summary(Path(run["run_dir"])) or {}
        if "global" in summary and summary["global"] is None:  # the algorithm declares no global model
            return NO_GLOBAL_MODEL
        return "no global-model numbers in its summary"
    return ""


def _scored_by(metric: Mapping[str, Any], column: Column) -> str:
    """A cell's pflkit metric as the outputs name it: final_clients with its client ids, e.g. final_clients[1]."""
    key = metric["pflkit"]
    return f"{key}[{' '.join(map(str, column.clients))}]" if column.clients else key


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Kendall's tau-a between two scorings of the same items (None with fewer than two items)."""
    n = len(a)
    if n < 2:
        return None
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x * y > 0) - (x * y < 0)
    return s / (n * (n - 1) / 2)


def reproduce(table: Table, out_dir: Path, rows: Optional[Sequence[str]] = None,
              cols: Optional[Sequence[str]] = None, seeds: Sequence[int] = (0,), scale: str = "paper",
              jobs: int = 1, echo: Callable[[str], None] = print, sets: Sequence[str] = (),
              runs_per_device: Optional[int] = None, launcher: Optional[Any] = None,
              tune_trials: Optional[int] = None) -> Dict[str, Any]:
    """Run the selected cells (every seed) and write ``results.md`` and ``results.csv`` into ``out_dir``.
    With ``tune_trials`` N every row of a column is first tuned with N trials on a validation split, and each cell
    also reports pflkit tuned: the test metric at the validation-selected round of the runs at the best options
    (core/results/tuned.py); those runs go to ``<column>-tune/``.
    With ``launcher`` (``launchers.LauncherSettings``) each column's runs still to do are submitted as jobs; the
    report then holds the finished cells and ``submitted`` / ``waiting`` (core/results/launchers.py).

    ``sets`` (``KEY=VALUE``, as ``fl run --set``) override every cell's config, e.g. ``device=cuda`` or a smaller
    ``rounds``; like ``quick`` scale, they label every output file and section as not the paper's setting.
    """
    if scale not in ("paper", "quick"):
        raise ConfigError(f"--scale {scale!r}: expected paper or quick")
    quick = scale == "quick"
    sets = list(sets)
    overrides = parse_sets(sets)
    scale_text = scale_label(quick, sets)
    tag = f"[{scale_text}] " if scale_text else ""
    row_ids = _select("rows", rows, [r.id for r in table.rows])
    col_ids = _select("cols", cols, [c.id for c in table.columns])
    chosen_rows = [r for r in table.rows if r.id in row_ids]
    chosen_cols = [c for c in table.columns if c.id in col_ids]
    missing = missing_data(table, chosen_cols, quick, overrides, chosen_rows[0] if chosen_rows else None)
    if missing:
        raise ConfigError("missing data, nothing run: " + "; ".join(missing))
    if runs_per_device is not None:  # refused before anything is measured when it cannot apply
        from .placement import plan_placement

        plan_placement([_cell_layer(table, c, quick, overrides).get("device") or "auto" for c in chosen_cols],
                       max(2, jobs), runs_per_device)
    out_dir = Path(out_dir)
    for column in table.columns:  # every folder this command writes lies inside --out (ids are plain names)
        inside_out(out_dir, out_dir / column.id)
    results: Dict[Tuple[str, str], Dict[str, Any]] = {}
    tuned_results: Dict[Tuple[str, str], Dict[str, Any]] = {}
    incomplete = 0
    submitted: List[str] = []
    waiting: List[str] = []
    done: Dict[str, Dict[str, Any]] = {}  # columns of one setting scored differently share one comparison
    specs = [_row_spec(r, overrides, quick) for r in chosen_rows]
    home: Dict[str, str] = {}  # setting -> the folder of its comparison: the table's first column of that setting,
    for column in table.columns:  # whichever columns are selected, so a narrower --cols reuses the runs
        home.setdefault(json.dumps(_cell_layer(table, column, quick, overrides), sort_keys=True, default=str),
                        column.id)
    echo(f"{tag}{estimate_table(table, chosen_cols, specs, seeds, quick, out_dir, home, jobs, echo, overrides, tag)}")
    for column in chosen_cols:
        layer = _cell_layer(table, column, quick, overrides)
        key = json.dumps(layer, sort_keys=True, default=str)
        if key in done:
            comparison = done[key]
            echo(f"{tag}{table.name} column {column.id} ({column.label}): the runs of column "
                 f"{comparison['column']}, scored by {_scored_by(column.metric, column)}")
        else:
            folder = out_dir / (home[key] + ("-tune" if tune_trials is not None else ""))
            echo(f"{tag}{table.name} column {column.id} ({column.label}): {len(chosen_rows)} rows x {len(seeds)} "
                 f"seeds in {folder}")
            comparison = run_comparison(specs, list(seeds), [layer], folder, jobs=jobs,
                                        echo=echo, runs_per_device=runs_per_device, launcher=launcher,
                                        tune_trials=tune_trials)
            submitted += comparison.get("submitted", [])
            waiting += [f"{home[key]}/{name}" for name in comparison.get("waiting", [])]
            if comparison.get("interrupted"):  # Ctrl-C stopped this column's runs: start no other column
                raise KeyboardInterrupt
            comparison["column"] = column.id
            done[key] = comparison
            incomplete += len(comparison["not_in_table"])
        by_label = {parse_entry(s).label: r for s, r in zip(specs, chosen_rows)}
        for label, entry in comparison["results"].items():
            tuned = label.endswith(TUNED_SUFFIX) and label[:-len(TUNED_SUFFIX)] in by_label
            row = by_label[label[:-len(TUNED_SUFFIX)] if tuned else label]
            metric = table.metric_of(row.id, column)
            if tuned:  # the tuned runs are read at the round chosen on validation, never the best on test
                metric = _tuned_metric(metric)
            runs = [{**run, "metric": comparison["metric"]} for run in entry["runs"]]
            values = [v for v in (_run_value(run, metric["pflkit"], column.clients) for run in runs) if v is not None]
            scale_factor = 100.0 if metric["percent"] else 1.0
            mean = std = None
            if values:  # population std over seeds (ddof=0), as fl compare reports it
                raw = sum(values) / len(values)
                mean = scale_factor * raw
                std = scale_factor * math.sqrt(sum((v - raw) ** 2 for v in values) / len(values))
            note = "" if values or not runs else _no_value_reason(runs[0], metric["pflkit"])
            (tuned_results if tuned else results)[row.id, column.id] = {"mean": mean, "std": std,
                                                                        "runs": len(values), "note": note}
    run_dirs = [Path(r["run_dir"]) for c in done.values() for e in c["results"].values() for r in e["runs"]]
    report = _report(table, chosen_rows, chosen_cols, results, list(seeds), quick, scale_text, run_dirs,
                     tuned_results if tune_trials is not None else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    inside_out(out_dir, out_dir / "results.md").write_text(report["markdown"])
    inside_out(out_dir, out_dir / "results.csv").write_text(report["csv"])
    report["incomplete"] = incomplete
    if launcher is not None:
        report.update({"launcher": launcher.name, "submitted": submitted, "waiting": waiting})
    report["files"] = {"markdown": str(out_dir / "results.md"), "csv": str(out_dir / "results.csv")}
    return report


def inside_out(out_dir: Path, path: Path) -> Path:
    """``path`` when, resolved (links followed), it lies inside ``out_dir``; else a ConfigError: nothing is written
    outside the folder the user named."""
    root = Path(out_dir).resolve()
    target = Path(path).resolve()
    if target != root and root not in target.parents:
        raise ConfigError(f"--out {out_dir}: {path} would be written outside it (at {target}); nothing written")
    return path


def estimate_table(table: Table, cols: Sequence[Column], specs: Sequence[str], seeds: Sequence[int], quick: bool,
                   out_dir: Path, home: Mapping[str, str], jobs: int, echo: Callable[[str], None],
                   overrides: Mapping[str, Any] = {}, tag: str = "") -> str:
    """The one line said before any cell runs: cells, runs, and the run time left with ``jobs``, measured from the
    first rounds of one run per row and setting (``estimate.py``: the measured runs continue, nothing is lost)."""
    from .estimate import estimate_comparisons, estimate_line

    settings: Dict[str, Any] = {}
    for column in cols:
        layer = _cell_layer(table, column, quick, overrides)
        settings.setdefault(json.dumps(layer, sort_keys=True, default=str), layer)
    folders = [(out_dir / home[key], layer) for key, layer in settings.items()]
    est = estimate_comparisons(folders, specs, seeds, jobs, echo=lambda line: echo(f"{tag}{line}"))
    what = (f"{table.name}{' at quick scale' if quick else ''}, {len(specs) * len(cols)} cells ({len(specs)} rows x "
            f"{len(cols)} columns, {len(folders)} setting(s)) x {len(seeds)} seed(s)")
    return estimate_line(est, what, jobs, _hour_unit(table, cols, quick, overrides))


def _hour_unit(table: Table, cols: Sequence[Column], quick: bool, overrides: Mapping[str, Any]) -> str:
    """GPU when the cells compute on CUDA (device cuda, or auto on a machine with a visible GPU), else CPU."""
    from .placement import visible_gpus

    # from the columns' own layers (a table and --set): resolving a cell would need a row whose options accept
    # every --set key; the core's default device is auto
    devices = {str(_cell_layer(table, c, quick, overrides).get("device") or "auto") for c in cols}
    if any(d.startswith("cuda") for d in devices) or ("auto" in devices and visible_gpus()):
        return "GPU"
    return "CPU"


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _report(table: Table, rows, cols, results, seeds: List[int], quick: bool, label: str,
            runs: Sequence[Path] = (), tuned: Optional[Mapping[Tuple[str, str], Dict[str, Any]]] = None
            ) -> Dict[str, Any]:
    tag = f"[{label}] " if label else ""
    scale = label or "paper"
    csv_rows = []
    for column in cols:
        agreement = _agreement(table, rows, column, results)  # the column's Kendall's tau and same winner, per row
        for row in rows:
            paper = table.numbers[row.id, column.id]
            ours = results.get((row.id, column.id), {"mean": None, "std": None, "runs": 0, "note": ""})
            diff = ours["mean"] - paper.mean if ours["mean"] is not None and paper.mean is not None else None
            if diff is None or paper.std is None:
                within = "n/a"
            else:
                within = "yes" if abs(diff) <= paper.std + 1e-9 else "no"
            csv_rows.append({"scale": scale, "table": table.name, "column": column.id, "row": row.id,
                             "metric": _scored_by(table.metric_of(row.id, column), column),
                             "paper_mean": _fmt(paper.mean),
                             "paper_std": _fmt(paper.std), "paper_note": paper.why_missing,
                             "pflkit_mean": _fmt(ours["mean"]), "pflkit_std": _fmt(ours["std"]),
                             "runs": ours["runs"], "pflkit_note": ours.get("note", ""), "difference": _fmt(diff),
                             "within_paper_spread": within, "column_kendall_tau": agreement["tau"],
                             "column_same_winner": agreement["same"]})
            if tuned is not None:  # --tune: the runs at the row's tuned options, read at the selected round
                mine = tuned.get((row.id, column.id), {"mean": None, "std": None, "runs": 0, "note": ""})
                tuned_agreement = _agreement(table, rows, column, tuned)
                csv_rows[-1].update({"tuned_mean": _fmt(mine["mean"]), "tuned_std": _fmt(mine["std"]),
                                     "tuned_runs": mine["runs"], "tuned_kendall_tau": tuned_agreement["tau"],
                                     "tuned_vs_untuned_kendall_tau": _orders_tau(rows, column, results, tuned)})
    from .published import provenance_of_runs, results_csv

    notes = (f"{label}: not comparable with the paper's numbers; " if label else "") + \
        f"{table.title()}; pflkit's std: population std over seeds"
    csv_text = results_csv(list(csv_rows[0]) if csv_rows else ["scale"], csv_rows,
                           provenance_of_runs(runs, seeds, notes))
    md = [f"# {tag}{table.title()}", ""]
    if label:
        what = "at quick scale (fewer rounds, a fraction of the data)" if quick else "at the paper's scale"
        if label != QUICK_LABEL:
            what += ", with every cell's config overridden by the command line's --set"
        md += [f"{tag}These numbers are {what}: they are not the paper's setting and are not comparable with its "
               f"numbers.", ""]
    m = table.metric
    md += [f"Paper's metric: {m['model']} model, {m['clients']} clients, {m['mean']} mean, "
           f"{'best round' if m['round'] == 'best' else 'mean of the last %s rounds' % m.get('k')}, "
           f"{'fine-tuned' if m['fine_tuned'] else 'not fine-tuned'}"
           + (f" ({m['note']})" if m.get("note") else "") + f". pflkit: {m['pflkit']}; seeds "
           f"{', '.join(map(str, seeds))}; pflkit's std is the population std over seeds.", ""]
    for column in cols:
        md += [f"## {tag}{column.label} ({column.id}; pflkit metric {_scored_by(column.metric, column)})", "",
               "| method | paper | pflkit | difference | within paper's spread |" + (
                   " pflkit tuned (selected round) |" if tuned is not None else ""),
               "|---|---|---|---|---|" + ("---|" if tuned is not None else "")]
        for r in csv_rows:
            if r["column"] != column.id:
                continue
            row_label = next(x.label for x in rows if x.id == r["row"])
            paper = (f"{r['paper_mean']} ± {r['paper_std']}" if r["paper_std"] else r["paper_mean"]) \
                or f"({r['paper_note']})"
            ours = f"{r['pflkit_mean']} ± {r['pflkit_std']}" if r["pflkit_mean"] else \
                f"n/a ({r['pflkit_note']})" if r["pflkit_note"] else "n/a"
            mine = "" if tuned is None else (f" {r['tuned_mean']} ± {r['tuned_std']} |" if r["tuned_mean"] else " n/a |")
            md.append(f"| {row_label} | {paper} | {ours} | {r['difference'] or 'n/a'} | "
                      f"{r['within_paper_spread']} |{mine}")
        md += ["", f"{_ranking(table, rows, column, results)}", ""]
        if tuned is not None:
            cell = next((r for r in csv_rows if r["column"] == column.id), {})
            md += [f"Tuned: {_ranking(table, rows, column, tuned)} Kendall's tau between pflkit's orders at the "
                   f"paper's options and tuned: {cell.get('tuned_vs_untuned_kendall_tau') or 'n/a'}.", ""]
    if table.chosen:
        md += [f"## {tag}Where the paper leaves a setting open, pflkit chose", ""]
        md += [f"- {c['setting']} = {c['value']}: {c['why']}" for c in table.chosen]
        md.append("")
    own = [r for r in rows if r.metric]
    if own:
        md += [f"## {tag}Rows scored unlike their columns", ""]
        md += [f"- {r.label}: {_own_metric_text(table, r, cols)}" for r in own]
        md.append("")
    md += [f"## {tag}Rows' hyperparameters", ""] + [f"- {r.label} (`{r.spec(quick)}`): {r.source}" for r in rows]
    return {"markdown": "\n".join(md) + "\n", "csv": csv_text, "cells": csv_rows}


def _own_metric_text(table: Table, row, cols) -> str:
    """A row with its own metric, as the report names it: which model, which pflkit key, and its note saying why."""
    metric = table.metric_of(row.id, cols[0]) if cols else row.metric
    return f"{metric['model']} model, pflkit metric {metric['pflkit']} ({metric['note']})"


def _agreement(table: Table, rows, column: Column, results) -> Dict[str, Any]:
    """The paper's and pflkit's orders of a column's rows (those with both numbers), Kendall's tau between them and
    whether the winner is the same; tau and same are '' with fewer than two such rows."""
    both = [r for r in rows if table.numbers[r.id, column.id].mean is not None
            and results.get((r.id, column.id), {}).get("mean") is not None]
    if len(both) < 2:
        return {"tau": "", "same": "", "paper": [], "ours": []}
    paper = [table.numbers[r.id, column.id].mean for r in both]
    ours = [results[r.id, column.id]["mean"] for r in both]
    order_p = [r.label for _, r in sorted(zip(paper, both), key=lambda t: -t[0])]
    order_o = [r.label for _, r in sorted(zip(ours, both), key=lambda t: -t[0])]
    return {"tau": _fmt(kendall_tau(paper, ours)), "same": "yes" if order_p[0] == order_o[0] else "no",
            "paper": order_p, "ours": order_o}


def _orders_tau(rows, column: Column, results, tuned) -> str:
    """Kendall's tau between pflkit's order of a column's rows at the paper's options and at the tuned ones."""
    both = [r for r in rows if (results.get((r.id, column.id)) or {}).get("mean") is not None
            and (tuned.get((r.id, column.id)) or {}).get("mean") is not None]
    return _fmt(kendall_tau([results[r.id, column.id]["mean"] for r in both],
                            [tuned[r.id, column.id]["mean"] for r in both]))


def _ranking(table: Table, rows, column: Column, results) -> str:
    a = _agreement(table, rows, column, results)
    if not a["paper"]:
        return "Ranking: fewer than two rows with both numbers."
    return (f"Ranking, paper: {' > '.join(a['paper'])}; pflkit: {' > '.join(a['ours'])}. Kendall's tau {a['tau']}; "
            f"same winner: {a['same']}.")
