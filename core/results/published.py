"""Results as data: every results table pflkit publishes is rendered from a CSV under ``results/``.

A results CSV is a plain CSV (any CSV reader takes it): the table's columns, then the provenance columns
:data:`PROVENANCE` -- the command that measured it, the commit, the date, the machine line (CPU model and the
vector kernels torch uses, CPU count, torch and numpy versions, device, torch threads), the seeds and notes -- with
the same values on every row. ``fl compare --out`` and ``fl reproduce --out`` write one (``results.csv``) from the
run directories' ``run_info.json`` (the machine and commit that computed the runs, also when the runs are reused).

A document shows one between markers; ``fl results`` re-makes the table from the CSV, ``fl results --check`` says
whether every document shows what its CSVs hold (the test suite runs it over README.md, docs/ and the plugins'
READMEs)::

    <!-- results: results/readme-compare.csv -->
    | algorithm | ... |
    <!-- /results -->

A marker may name the columns to show, separated by ``|``: ``<!-- results: results/x.csv | row | paper -->``; by
default every column but the provenance columns (``\\|`` for a ``|`` in a column's name).
"""
from __future__ import annotations

import csv
import io
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import ConfigError

PROVENANCE = ("command", "commit", "date", "machine", "seeds", "notes")
RESULTS_DIR = "results"
_OPEN = re.compile(r"^<!-- results: (?P<spec>.+?) -->\s*$")
_CLOSE = "<!-- /results -->"
CSV_LIMIT = 4 * 2 ** 20  # a results CSV is a table of a page, not a data dump


# -- provenance ----------------------------------------------------------------------------------------------------
def machine_line(entry: Mapping[str, Any]) -> str:
    """A run_info.json entry's machine as one line: ``AMD EPYC 7B13 (2 CPUs, AVX512 kernels), torch 2.14.1, numpy
    2.4.6, device cpu, 1 torch thread``."""
    libs = entry.get("libraries") or {}
    cpu = entry.get("cpu_model") or entry.get("device_name") or "unknown CPU"
    inside = ", ".join(x for x in (f"{entry['cpu_count']} CPUs" if entry.get("cpu_count") else "",
                                   f"{entry['cpu_capability']} kernels" if entry.get("cpu_capability") else "") if x)
    device = str(entry.get("device") or "?")
    if entry.get("device_name") and device.startswith("cuda"):
        device += f" ({entry['device_name']})"
    threads = entry.get("threads")
    return (f"{cpu}{f' ({inside})' if inside else ''}, torch {entry.get('torch') or libs.get('torch') or '?'}, "
            f"numpy {libs.get('numpy') or '?'}, device {device}"
            + (f", {threads} torch thread{'s' if threads != 1 else ''}" if isinstance(threads, int) else ""))


def this_machine(device: str = "cpu", threads: Optional[int] = 1) -> str:
    """The machine line of this process (for a table measured without run directories)."""
    import os

    from ..storage.runinfo import cpu_capability, cpu_model, library_versions

    import torch

    return machine_line({"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpu_capability": cpu_capability(),
                         "torch": torch.__version__, "libraries": library_versions(), "device": device,
                         "threads": threads})


def _joined(values: Iterable[str]) -> str:
    out: List[str] = []
    for v in values:
        if v and v not in out:
            out.append(v)
    return "; ".join(out)


def provenance_of_runs(run_dirs: Sequence[Path], seeds: Sequence[int], notes: str = "",
                       command: Optional[str] = None) -> Dict[str, str]:
    """The provenance columns of a table computed from ``run_dirs``: the machines and commits that computed their
    rounds (every ``run_info.json`` entry: a resumed run may have moved), the dates (first .. last), the command
    that writes the table (this process's, by default) and ``seeds``."""
    from ..storage.runinfo import read

    entries = [e for d in run_dirs for e in read(Path(d)) if isinstance(e, dict)]
    commits, unrecorded = [], 0
    for e in entries:
        git = e.get("git") if isinstance(e.get("git"), dict) else None
        if git and git.get("commit"):
            commits.append(str(git["commit"])[:10] + (" (uncommitted changes)" if git.get("dirty") else ""))
        else:
            unrecorded += 1
    if commits and unrecorded:  # some runs name no commit: say so rather than let the others speak for them
        commits.append(f"not recorded for {unrecorded} of {len(entries)} run starts")
    dates = sorted(str(e["time"])[:10] for e in entries if isinstance(e.get("time"), str))
    return {
        "command": command if command is not None else _this_command(),
        "commit": _joined(commits) or "not recorded (the runs' run_info.json names no git commit)",
        "date": (dates[0] if dates[0] == dates[-1] else f"{dates[0]} .. {dates[-1]}") if dates else
        datetime.now().date().isoformat(),
        "machine": _joined(machine_line(e) for e in entries) or this_machine(),
        "seeds": " ".join(str(s) for s in seeds),
        "notes": notes,
    }


def _this_command() -> str:
    argv = list(sys.argv)
    if argv:
        argv[0] = Path(argv[0]).name  # fl, not the venv's absolute path
    return shlex.join(argv)


# -- writing and reading -------------------------------------------------------------------------------------------
def results_csv(columns: Sequence[str], rows: Sequence[Mapping[str, Any]], provenance: Mapping[str, str]) -> str:
    """The CSV text: ``columns`` then :data:`PROVENANCE`, one line per row (missing cells empty)."""
    clash = [c for c in columns if c in PROVENANCE]
    if clash:
        raise ValueError(f"results column {clash[0]!r} is a provenance column name")
    from ..storage.rundata import csv_cell  # fl export's cells: text a spreadsheet would run as a formula escaped

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([csv_cell("", c) for c in [*columns, *PROVENANCE]])
    for row in rows:
        writer.writerow([csv_cell(c, row.get(c)) for c in columns] +
                        [csv_cell(p, provenance.get(p, "")) for p in PROVENANCE])
    return buf.getvalue()


def read_results_csv(path: Path) -> Tuple[List[str], List[Dict[str, str]]]:
    """(columns, rows) of a results CSV, read as untrusted data: a regular file, bounded, every row as long as the
    header, the provenance columns present."""
    from ..common.safefiles import read_regular

    try:
        raw = read_regular(Path(path), CSV_LIMIT)
    except FileNotFoundError:
        raise ConfigError(f"results file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"results file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        reader = csv.reader(io.StringIO(raw.decode("utf-8")))
        header, *lines = list(reader)
    except (UnicodeDecodeError, csv.Error, ValueError):
        raise ConfigError(f"results file {path} is not a UTF-8 CSV with a header line") from None
    missing = [p for p in PROVENANCE if p not in header]
    if missing:
        raise ConfigError(f"results file {path} lacks the provenance column '{missing[0]}' (a results CSV ends "
                          f"with the columns {', '.join(PROVENANCE)})")
    for n, line in enumerate(lines, start=2):
        if len(line) != len(header):
            raise ConfigError(f"results file {path}, line {n}: {len(line)} cells where the header has "
                              f"{len(header)}")
    return header, [dict(zip(header, line)) for line in lines]


NOT_REMEASURED = "not re-measured"


def provenance_problem(path: Path) -> Optional[str]:
    """Why a published results CSV does not come from one clean commit (None when it does): its runs name a tree with
    uncommitted changes, more than one commit, or runs that recorded none beside ones that did. A CSV whose notes
    say "not re-measured" is a record kept as it was, and passes."""
    _, rows = read_results_csv(path)
    if not rows or any(NOT_REMEASURED in r.get("notes", "") for r in rows):
        return None
    entries = {e.strip() for r in rows for e in r.get("commit", "").split(";") if e.strip()}
    dirty = sorted(e for e in entries if "uncommitted changes" in e)
    unrecorded = sorted(e for e in entries if e.startswith("not recorded"))
    commits = {e.split()[0] for e in entries if not e.startswith("not recorded")}
    why = []
    if dirty:
        why.append(f"runs from trees with uncommitted changes ({'; '.join(dirty)})")
    if len(commits) > 1:
        why.append(f"runs from {len(commits)} commits ({', '.join(sorted(commits))})")
    if unrecorded and commits:
        why.append(f"runs that recorded no commit beside ones that did ({unrecorded[0]})")
    if not why:
        return None
    return (f"{path}: {' and '.join(why)}; re-measure it from one clean commit, or say '{NOT_REMEASURED}' in its "
            f"notes")


def render_table(path: Path, columns: Optional[Sequence[str]] = None) -> str:
    """The Markdown table of a results CSV (its ``columns``; by default all but the provenance columns)."""
    header, rows = read_results_csv(path)
    shown = list(columns) if columns else [c for c in header if c not in PROVENANCE]
    for c in shown:
        if c not in header:
            from ..common.errors import did_you_mean

            raise ConfigError(f"results file {path} has no column '{c}'.{did_you_mean(c, header)} Columns: "
                              f"{', '.join(header)}")
    lines = ["| " + " | ".join(_md(c) for c in shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_md(r[c]) for c in shown) + " |" for r in rows]
    return "\n".join(lines)


def _md(text: str) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|")


# -- documents -----------------------------------------------------------------------------------------------------
def _parse_spec(spec: str) -> Tuple[str, List[str]]:
    path, *cols = [p.strip().replace("\\|", "|") for p in re.split(r"(?<!\\)\|", spec)]  # \| in a name
    return path, [c for c in cols if c]


def render_document(text: str, root: Path, where: str = "document") -> Tuple[str, List[str], List[str]]:
    """``text`` with every marked table re-made from its CSV (paths relative to ``root``, the repository root);
    the CSV paths of the tables that changed; and of every marked table. Markers inside a fenced code block are
    examples, left alone."""
    lines = text.split("\n")
    out: List[str] = []
    changed: List[str] = []
    shown: List[str] = []
    i, fence = 0, False
    while i < len(lines):
        if lines[i].startswith("```"):
            fence = not fence
        match = None if fence else _OPEN.match(lines[i])  # a marker shown in a code block is an example
        if not match:
            if fence:
                out.append(lines[i])
                i += 1
                continue
            if lines[i].strip() == _CLOSE:
                raise ConfigError(f"{where}, line {i + 1}: {_CLOSE} without an opening <!-- results: FILE -->")
            out.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == _CLOSE), None)
        if end is None or any(_OPEN.match(lines[j]) for j in range(i + 1, end)):
            raise ConfigError(f"{where}, line {i + 1}: <!-- results: ... --> is not closed by {_CLOSE}")
        rel, columns = _parse_spec(match.group("spec"))
        path = (root / rel).resolve()
        if root.resolve() not in path.parents:
            raise ConfigError(f"{where}, line {i + 1}: results file {rel} is outside {root}")
        try:
            table = render_table(path, columns)
        except ConfigError as exc:
            raise ConfigError(f"{where}, line {i + 1}: {exc}") from None
        shown.append(rel)
        old = "\n".join(lines[i + 1:end])
        if old != table:
            changed.append(rel)
        out += [lines[i], table, lines[end]]
        i = end + 1
    return "\n".join(out), changed, shown


def published_documents(root: Path) -> List[Path]:
    """The documents whose tables pflkit publishes: README.md, docs/*.md and every plugin's README.md."""
    root = Path(root)
    found = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(root.glob("plugins/*/README.md"))]
    return [p for p in found if p.is_file()]


def unmarked_result_tables(text: str) -> List[int]:
    """Line numbers of Markdown tables with a ``mean ± std`` cell outside any results marker: numbers typed into a
    document instead of rendered from a CSV."""
    found, inside, fence, start = [], False, False, None
    lines = text.split("\n")
    for n, line in enumerate(lines + [""], start=1):
        if line.startswith("```"):
            fence = not fence
        is_row = line.startswith("|") and not fence
        if is_row and start is None:
            start = n
        if not is_row and start is not None:
            if not inside and any("±" in lines[k - 1] for k in range(start, n)):
                found.append(start)
            start = None
        if _OPEN.match(line):
            inside = True
        elif line.strip() == _CLOSE:
            inside = False
    return found
