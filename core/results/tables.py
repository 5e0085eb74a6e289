"""A paper's comparison table as data: the schema of a ``pflkit.tables`` file, checked strictly.

A plugin publishes its paper's tables through the ``pflkit.tables`` entry-point group (``name = package:file.toml``);
``fl reproduce --table-file PATH`` reads one from a path. The file (TOML) holds:

- ``[paper]``: ``title``, ``venue``, ``table`` (its number in the paper), ``caption``;
- ``[metric]``: what the paper scores -- ``model`` (personal | global), ``clients`` (all | sampled), ``mean``
  (uniform | weighted | per_client), ``round`` (best | last_k), ``k`` (with last_k), ``fine_tuned`` (true | false)
  -- and ``pflkit``, the key that computes it here (:data:`PFLKIT_METRICS`), ``percent`` (the paper's numbers are
  percentages of pflkit's 0..1 accuracy), ``note``; a column may replace any of these with its own ``metric`` table,
  and a row with its own (which must carry its own ``note`` saying why): a cell's metric is the row's ``metric`` over
  the column's over the file's. ``model = "global"`` needs a ``*_global_*`` pflkit key (the global model's accuracy
  on every client's test split, summary.json's ``global`` section) and ``model = "personal"`` one without ``global``;
  so a table that scores the global model scores a method without one (e.g. FedPer) by its personal model through a
  row ``metric = { model = "personal", pflkit = "...", note = "..." }``;
- ``[settings]``: config overrides shared by every cell (a config layer, as ``fl run --config`` reads);
- ``[quick]``: overrides of ``--scale quick`` (fewer rounds, ``split.fraction``); without it :data:`QUICK_RULE`;
- ``[[columns]]``: ``id``, ``label``, ``set`` (config overrides), optionally ``quick``, ``metric`` and ``clients``
  (a client id or a list of them, e.g. a domain's clients, scored with ``pflkit = "final_clients"``: each run's
  ``final.per_client`` in summary.json, their uniform mean when several);
- ``[[rows]]``: ``id``, ``label``, ``plugin``, ``options`` (config overrides of that method: its ``fl compare``
  entry ``plugin+key=value...``), ``source`` (where its hyperparameters come from), optionally ``metric`` and
  ``quick`` (overrides of its own options at ``--scale quick``, e.g. a smaller flow: a row's options outrank the
  table's ``[quick]``);
- ``[numbers.<row id>]``: per column id ``[mean, std]``, ``[mean]`` (no std reported) or a string saying why the
  paper has no number for that cell;
- ``[[chosen]]``: ``setting``, ``value``, ``why`` -- what pflkit chose where the paper leaves a setting open.

Unknown keys are refused with a did-you-mean, as in configs. :func:`check_table` also resolves every cell's config
through the config resolver (known algorithms, valid option values) without loading any data.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..api import registry as reg
from ..api.registry import TableFile, parse_table_text
from ..common.errors import ConfigError, PflError, did_you_mean
from ..engine.config import deep_merge, resolve

#: pflkit's summary keys a table's metric may name: the mean over seeds of each run's ...
PFLKIT_METRICS = {
    "final_uniform": "mean over clients of each client's metric, averaged over the last eval.final_k evaluations",
    "final_weighted": "metric pooled over every test sample, averaged over the last eval.final_k evaluations",
    "best_uniform": "best evaluation of the mean over clients",
    "best_weighted": "best evaluation of the metric pooled over every test sample (sample-weighted mean)",
    "selected_uniform": "mean over clients at the evaluation with the best validation mean (split.val > 0)",
    "selected_weighted": "metric pooled over every test sample at the evaluation with the best pooled validation "
                         "metric (split.val > 0)",
    "selected_per_client": "each client's metric at its own best validation evaluation, mean over clients "
                           "(split.val > 0)",
    "final_min": "lowest client's metric, averaged over the last eval.final_k evaluations",
    "final_max": "highest client's metric, averaged over the last eval.final_k evaluations",
    "final_clients": "the column's clients' metric (each averaged over the last eval.final_k evaluations: the "
                     "summary's final.per_client), their uniform mean when several",
    "final_global_uniform": "the global model's metric on every client's test split, mean over clients, averaged "
                            "over the last eval.final_k evaluations",
    "final_global_weighted": "the global model's metric pooled over every client's test samples, averaged over the "
                             "last eval.final_k evaluations",
    "best_global_uniform": "best evaluation of the global model's mean over clients",
    "best_global_weighted": "best evaluation of the global model's metric pooled over every test sample",
}
METRIC_CHOICES = {"model": ("personal", "global"), "clients": ("all", "sampled"),
                  "mean": ("uniform", "weighted", "per_client"), "round": ("best", "last_k")}
QUICK_RULE = "rounds = max(2, rounds // 10) and split.fraction = 0.2 (when the table gives no [quick])"
TOP_KEYS = ("paper", "metric", "settings", "quick", "columns", "rows", "numbers", "chosen")
PAPER_KEYS = ("title", "venue", "table", "caption")
METRIC_KEYS = ("model", "clients", "mean", "round", "k", "fine_tuned", "pflkit", "percent", "note")
COLUMN_KEYS = ("id", "label", "set", "quick", "metric", "clients")
ROW_KEYS = ("id", "label", "plugin", "options", "quick", "source", "metric")
CHOSEN_KEYS = ("setting", "value", "why")


@dataclass
class Column:
    id: str
    label: str
    set: Dict[str, Any]
    quick: Optional[Dict[str, Any]]
    metric: Dict[str, Any]
    clients: Optional[List[int]] = None  # the client ids a final_clients column scores (one client, or a group)


@dataclass
class Row:
    id: str
    label: str
    plugin: str
    options: Dict[str, Any]
    source: str
    metric: Optional[Dict[str, Any]] = None  # the row's own metric keys (over its columns'), None when it has none
    quick: Optional[Dict[str, Any]] = None  # the row's own --scale quick overrides of its options (e.g. a smaller flow)

    def options_at(self, quick: bool = False) -> Dict[str, Any]:
        """The row's options; at quick scale with its own ``quick`` overrides on top."""
        return deep_merge(self.options, self.quick) if quick and self.quick else dict(self.options)

    def spec(self, quick: bool = False) -> str:
        """The row as an ``fl compare`` entry: ``plugin+key=value...`` (the row id labels it in the results)."""
        return "+".join([self.plugin, *(f"{k}={_value_text(v)}" for k, v in _flat(self.options_at(quick)))])


@dataclass
class Cell:
    mean: Optional[float]
    std: Optional[float]
    why_missing: str = ""


@dataclass
class Table:
    name: str
    origin: str
    paper: Dict[str, Any]
    metric: Dict[str, Any]
    settings: Dict[str, Any]
    quick: Optional[Dict[str, Any]]
    columns: List[Column]
    rows: List[Row]
    numbers: Dict[Tuple[str, str], Cell]
    chosen: List[Dict[str, str]] = field(default_factory=list)
    cell_metrics: Dict[Tuple[str, str], Dict[str, Any]] = field(default_factory=dict)  # (row, column): a row's own

    def metric_of(self, row: str, column: Column) -> Dict[str, Any]:
        """The metric of a cell: the row's ``metric`` over the column's over the file's."""
        return self.cell_metrics.get((row, column.id), column.metric)

    def title(self) -> str:
        return f"{self.paper['title']} ({self.paper['venue']}), Table {self.paper['table']}: {self.paper['caption']}"

    def datasets(self) -> Dict[str, str]:
        """Column id -> the dataset name its cells use (settings < column)."""
        return {c.id: str(self.layer(c).get("dataset", {}).get("name", "?")) for c in self.columns}

    def cell_config(self, row_id: str, column_id: str, quick: bool = False) -> Any:
        """The resolved config of one cell (seed 0) as ``fl reproduce`` runs it: the column's layer under the row's
        options (with its own ``quick`` at quick scale); what a table's tests check the paper's settings against."""
        from ..engine.config import parse_sets
        from .compare import parse_entry

        row = next((r for r in self.rows if r.id == row_id), None)
        column = next((c for c in self.columns if c.id == column_id), None)
        if row is None or column is None:
            raise ConfigError(f"table {self.name}: no row {row_id!r}" if row is None else
                              f"table {self.name}: no column {column_id!r}")
        entry = parse_entry(row.spec(quick))
        return resolve([self.layer(column, quick), parse_sets(entry.sets), {"seed": 0}], algorithm=entry.algorithm)

    def layer(self, column: Column, quick: bool = False) -> Dict[str, Any]:
        """The config layer of a column's cells: shared settings < column < quick-scale overrides."""
        out = deep_merge(self.settings, column.set)
        if quick:
            out = deep_merge(out, quick_overrides(self, column))
        return out


def quick_overrides(table: Table, column: Column) -> Dict[str, Any]:
    """``--scale quick``: the column's ``quick``, else the table's ``[quick]``, else :data:`QUICK_RULE`."""
    if column.quick is not None:
        return column.quick
    if table.quick is not None:
        return table.quick
    rounds = deep_merge(table.settings, column.set).get("rounds")
    rounds = rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else 20
    return {"rounds": max(2, rounds // 10), "split": {"fraction": 0.2}}


def _flat(tree: Mapping[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _value_text(value: Any) -> str:
    """A value as ``--set`` reads it back (parse_value: JSON-like; a bare word is a string)."""
    import json

    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def _keys(where: str, values: Any, allowed: Sequence[str], required: Sequence[str] = ()) -> Dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a table, got {values!r}")
    for key in values:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key '{key}'.{did_you_mean(key, allowed)} Valid keys: "
                              f"{', '.join(allowed)}")
    for key in required:
        if key not in values:
            raise ConfigError(f"{where}: '{key}' is missing")
    return dict(values)


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected text, got {value!r}")
    return value


def _metric(where: str, values: Any, base: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    m = _keys(where, values, METRIC_KEYS, () if base else ("model", "clients", "mean", "round", "fine_tuned",
                                                            "pflkit"))
    out = {**(base or {}), **m}
    for key, choices in METRIC_CHOICES.items():
        if out.get(key) not in choices:
            raise ConfigError(f"{where}.{key}: {out.get(key)!r} is not one of {', '.join(choices)}")
    if out["pflkit"] not in PFLKIT_METRICS:
        raise ConfigError(f"{where}.pflkit: unknown pflkit metric {out['pflkit']!r}."
                          f"{did_you_mean(str(out['pflkit']), PFLKIT_METRICS)} Known: {', '.join(PFLKIT_METRICS)}")
    if (out["model"] == "global") != is_global_key(out["pflkit"]):
        keys = [k for k in PFLKIT_METRICS if is_global_key(k) == (out["model"] == "global")]
        raise ConfigError(f"{where}: model = {out['model']!r} is not scored by pflkit = {out['pflkit']!r}, a "
                          f"{'global' if is_global_key(out['pflkit']) else 'personal'} model's key; use one of "
                          f"{', '.join(keys)}")
    if out["round"] == "last_k" and not (isinstance(out.get("k"), int) and out["k"] >= 1):
        raise ConfigError(f"{where}.k: round = 'last_k' needs k, a positive integer")
    if not isinstance(out["fine_tuned"], bool):
        raise ConfigError(f"{where}.fine_tuned: expected true or false")
    out.setdefault("percent", True)
    if not isinstance(out["percent"], bool):
        raise ConfigError(f"{where}.percent: expected true or false")
    return out


def is_global_key(key: str) -> bool:
    """Whether a pflkit metric key scores the global model (``*_global_*``) rather than the personal one."""
    return "_global_" in key


def _clients(where: str, value: Any, pflkit: str) -> Optional[List[int]]:
    """A column's ``clients``: one client id or a list of them, given exactly when its metric is final_clients."""
    if value is None:
        if pflkit == "final_clients":
            raise ConfigError(f"{where}: pflkit metric 'final_clients' needs clients = <id> or [<id>, ...]")
        return None
    ids = [value] if not isinstance(value, list) else value
    if not ids or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids) \
            or len(set(ids)) != len(ids):
        raise ConfigError(f"{where}.clients: expected a client id or a list of distinct client ids (integers >= 0), "
                          f"got {value!r}")
    if pflkit != "final_clients":
        raise ConfigError(f"{where}.clients: scoring clients by id needs metric.pflkit = 'final_clients', "
                          f"not {pflkit!r}")
    return list(ids)


# Ids name folders (``OUT/<column id>``), runs and CSV cells: plain names only, so none can leave --out or forge a line
MAX_ID = 64
PLAIN_ID = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9_.-]{{0,{MAX_ID - 1}}}")
PLAIN_ID_WORDS = (f"a plain name: letters, digits, '_', '-' and '.' (not first), at most {MAX_ID} characters")


def plain_id(where: str, value: str) -> str:
    """``value`` when it is a plain name (PLAIN_ID), else a ConfigError naming ``where`` and why."""
    if not PLAIN_ID.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ConfigError(f"{where}: {shown!r} is not {PLAIN_ID_WORDS}")
    return value


def check_table_name(name: str) -> str:
    """A table's name is ``plugin:table`` (or one plain name), each part a plain name."""
    for part in name.split(":", 1):
        plain_id(f"table name {name!r}", part)
    return name


def _ids(where: str, items: Any, keys: Sequence[str], required: Sequence[str]) -> List[Dict[str, Any]]:
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: expected at least one [[{where}]] entry")
    out, seen = [], set()
    for i, item in enumerate(items):
        entry = _keys(f"{where}[{i}]", item, keys, required)
        ident = plain_id(f"{where}[{i}].id", _text(f"{where}[{i}].id", entry["id"]))
        if ident in seen:
            raise ConfigError(f"{where}[{i}].id: '{ident}' is listed twice")
        seen.add(ident)
        out.append(entry)
    return out


NUMBER_TEXT = re.compile(r"\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*(%|±.*|\+-.*)?\s*")


def _number(where: str, value: Any) -> Cell:
    if isinstance(value, str):
        if NUMBER_TEXT.fullmatch(value):  # "83.3" or "83.3 ± 0.1": a number typed as text, not why one is missing
            raise ConfigError(f"{where}: {value!r} is a number written as text; write [mean, std] or [mean] (a string "
                              f"says why the paper has no number)")
        return Cell(None, None, _text(where, value))
    if not isinstance(value, list) or len(value) not in (1, 2) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise ConfigError(f"{where}: expected [mean, std], [mean] (no std reported) or a string saying why the paper "
                          f"has no number, got {value!r}")
    if len(value) == 2 and value[1] < 0:
        raise ConfigError(f"{where}: std {value[1]!r} is negative; a standard deviation is >= 0")
    return Cell(float(value[0]), float(value[1]) if len(value) == 2 else None)


def parse_table(name: str, source: TableFile) -> Table:
    """Check a table file's schema (every key, every number present); ConfigError naming the file otherwise."""
    try:
        return _parse(name, source)
    except ConfigError as exc:
        raise ConfigError(f"table {name} ({source.origin}): {exc}") from None


def _parse(name: str, source: TableFile) -> Table:
    check_table_name(name)
    data = _keys("file", source.data, TOP_KEYS, ("paper", "metric", "settings", "columns", "rows", "numbers"))
    paper = _keys("paper", data["paper"], PAPER_KEYS, PAPER_KEYS)
    for key in ("title", "venue", "caption"):
        _text(f"paper.{key}", paper[key])
    if isinstance(paper["table"], bool) or not isinstance(paper["table"], (int, str)):
        raise ConfigError(f"paper.table: expected the table's number, got {paper['table']!r}")
    metric = _metric("metric", data["metric"])
    settings = _keys("settings", data["settings"], tuple(data["settings"]) if isinstance(data["settings"], Mapping)
                     else ())
    quick = data.get("quick")
    if quick is not None and not isinstance(quick, Mapping):
        raise ConfigError(f"quick: expected a table of config overrides, got {quick!r}")
    columns = []
    for i, c in enumerate(_ids("columns", data["columns"], COLUMN_KEYS, ("id", "label"))):
        for key in ("set", "quick"):
            if key in c and not isinstance(c[key], Mapping):
                raise ConfigError(f"columns[{i}].{key}: expected a table of config overrides")
        col_metric = _metric(f"columns[{i}].metric", c["metric"], metric) if "metric" in c else metric
        columns.append(Column(c["id"], _text(f"columns[{i}].label", c["label"]), dict(c.get("set", {})),
                              dict(c["quick"]) if "quick" in c else None, col_metric,
                              _clients(f"columns[{i}]", c.get("clients"), col_metric["pflkit"])))
    rows = []
    cell_metrics: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for i, r in enumerate(_ids("rows", data["rows"], ROW_KEYS, ("id", "label", "plugin", "source"))):
        for key in ("options", "quick"):
            if key in r and not isinstance(r[key], Mapping):
                raise ConfigError(f"rows[{i}].{key}: expected a table of config overrides")
        own = None
        if "metric" in r:
            own = _keys(f"rows[{i}].metric", r["metric"], METRIC_KEYS, ("note",))
            _text(f"rows[{i}].metric.note", own["note"])  # a row scored unlike its columns says why
            for column in columns:
                cell = _metric(f"rows[{i}].metric (column {column.id})", own, column.metric)
                if (cell["pflkit"] == "final_clients") != (column.clients is not None):
                    raise ConfigError(f"rows[{i}].metric (column {column.id}): pflkit = {cell['pflkit']!r} in a "
                                      f"column that " + ("scores clients by id: keep 'final_clients'"
                                                         if column.clients is not None else "names no clients"))
                cell_metrics[r["id"], column.id] = cell
        rows.append(Row(r["id"], _text(f"rows[{i}].label", r["label"]), _text(f"rows[{i}].plugin", r["plugin"]),
                        dict(r.get("options", {})), _text(f"rows[{i}].source", r["source"]), own,
                        dict(r["quick"]) if "quick" in r else None))
    numbers_in = _keys("numbers", data["numbers"], [r.id for r in rows], [r.id for r in rows])
    numbers: Dict[Tuple[str, str], Cell] = {}
    col_ids = [c.id for c in columns]
    for row in rows:
        per_col = _keys(f"numbers.{row.id}", numbers_in[row.id], col_ids, col_ids)
        for col in col_ids:
            numbers[row.id, col] = _number(f"numbers.{row.id}.{col}", per_col[col])
    chosen = []
    for i, c in enumerate(data.get("chosen", [])):
        entry = _keys(f"chosen[{i}]", c, CHOSEN_KEYS, CHOSEN_KEYS)
        chosen.append({k: _text(f"chosen[{i}].{k}", str(entry[k])) for k in CHOSEN_KEYS})
    return Table(name, source.origin, paper, metric, dict(settings), dict(quick) if quick is not None else None,
                 columns, rows, numbers, chosen, cell_metrics)


def read_table_file(path: str) -> Tuple[str, TableFile]:
    """A table file given by path (``fl reproduce --table-file``): its name is the file's stem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"table file {path!r} does not exist")
    if p.stat().st_size > reg.TABLE_FILE_LIMIT:
        raise ConfigError(f"table file {path!r} is larger than {reg.TABLE_FILE_LIMIT} bytes; not a table file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"table file {path!r} cannot be read: {exc}") from None
    try:
        return p.stem, parse_table_text(text, str(p))
    except PflError as exc:
        raise ConfigError(str(exc)) from None


def installed_table(name: str) -> Table:
    """The table registered as ``name`` (``fl list tables``), schema-checked."""
    return parse_table(name, reg.TABLES.get(name))


def _check_rounds_scored(metric: Dict[str, Any], cfg: Any) -> None:
    """A cell scored as the mean of the paper's last k rounds must average the evaluations of exactly those rounds:
    a plugin's default ``eval.every`` (PCFL's is 5, to save time) would otherwise make its "last 10 rounds" the
    evaluations of rounds 5, 10, ..., 50 while the other rows average rounds 41-50. The core evaluates every
    ``eval.every``-th round and the last one (core/engine/rounds.py)."""
    if metric.get("round") != "last_k":
        return
    k, every, final_k, rounds = int(metric["k"]), int(cfg.eval.every), int(cfg.eval.final_k), int(cfg.rounds)
    if final_k != k:
        raise ConfigError(f"eval.final_k = {final_k}: the metric is the mean of the last {k} rounds; set "
                          f"eval.final_k = {k}")
    scored = [r for r in range(1, rounds + 1) if r % every == 0 or r == rounds][-k:]
    if scored != list(range(max(1, rounds - k + 1), rounds + 1)):
        raise ConfigError(f"eval.every = {every}: the metric is the mean of the last {k} rounds, but the last {k} "
                          f"evaluations are of rounds {scored[0]}-{scored[-1]} (every {every}th); set eval = "
                          f"{{ every = 1 }} in the table's settings")


def check_table(table: Table) -> int:
    """Resolve every cell's config (paper and quick scale) without loading data: known algorithms, valid option
    values, valid configs. Returns the number of cells checked; ConfigError naming the cell otherwise."""
    from ..results.compare import parse_entry
    from ..engine.config import parse_sets

    for quick in (False, True):  # fl compare runs one entry per spec: two rows alike would be one run, scored twice
        seen: Dict[str, str] = {}
        for row in table.rows:
            other = seen.setdefault(row.spec(quick), row.id)
            if other != row.id:
                raise ConfigError(f"table {table.name}: rows {other} and {row.id} run the same method with the same "
                                  f"options{' at quick scale' if quick else ''} ({row.spec(quick)}); give one of them "
                                  f"the option that tells them apart, or score both in one row")
    cells = 0
    for column in table.columns:
        for quick in (False, True):
            layer = table.layer(column, quick)
            for row in table.rows:
                where = f"table {table.name}, row {row.id}, column {column.id}" + (" (quick scale)" if quick else "")
                try:
                    entry = parse_entry(row.spec(quick))
                    if entry.algorithm not in reg.ALGORITHMS:
                        raise ConfigError(f"unknown algorithm '{entry.algorithm}'."
                                          f"{did_you_mean(entry.algorithm, reg.ALGORITHMS.names())}")
                    cfg = resolve([layer, parse_sets(entry.sets), {"seed": 0}], algorithm=entry.algorithm)
                    if not quick:
                        _check_rounds_scored(table.metric_of(row.id, column), cfg)
                except PflError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
                cells += not quick
    from .chosen import check_chosen

    check_chosen(table)  # [[chosen]] says only what the table sets
    return cells
