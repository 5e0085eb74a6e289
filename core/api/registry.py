"""Entry-point registries for every pluggable kind.

Each kind is one entry-point group. Built-ins register through the same groups as third-party packages, so
discovery is uniform: entries are listed from installed metadata without importing them, and an entry is imported
only when asked for. A failing import is recorded (name, distribution, error) and never stops other entries from
loading. In-process registration (``@MODELS.register("name")``) serves tests and notebooks.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

from ..common.errors import PluginError, UnknownNameError, unknown_name  # noqa: F401 (re-exported)

try:  # the backport has the same API on every Python version we support
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore

GROUP_PREFIX = "pflkit"


@dataclass
class Entry:
    """One named provider of a kind: where it comes from and, once loaded, the object itself."""

    name: str
    kind: str
    target: str  # "module:attr" for entry points, repr for in-process objects
    dist: str
    version: str
    obj: Any = None
    loaded: bool = False


@dataclass
class LoadFailure:
    kind: str
    name: str
    dist: str
    error: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} '{self.name}' from distribution '{self.dist}' failed to load: {self.error}"


@dataclass
class Registry:
    """The providers of one kind (datasets, models, trainers, ...)."""

    kind: str
    group: str
    _entries: Dict[str, Entry] = field(default_factory=dict)
    _conflicts: Dict[str, List[Entry]] = field(default_factory=dict)
    _failures: Dict[str, LoadFailure] = field(default_factory=dict)
    _discovered: bool = False
    # how an entry point becomes the object (default: import ``module:attr``); the tables kind reads a data file
    load_entry: Optional[Callable[[Any], Any]] = None

    # -- discovery -------------------------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        seen: Dict[str, Entry] = {}
        for ep in metadata.entry_points(group=self.group):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            entry = Entry(ep.name, self.kind, ep.value, dist, version)
            entry._ep = ep  # type: ignore[attr-defined]
            previous = seen.get(ep.name)
            if previous is not None:
                if previous.dist == dist:  # same distribution seen twice on sys.path: not a conflict
                    continue
                self._conflicts.setdefault(ep.name, [previous]).append(entry)
                continue
            seen[ep.name] = entry
        for name, entry in seen.items():
            self._entries.setdefault(name, entry)  # in-process registrations made earlier win

    def refresh(self) -> None:
        """Forget discovered (not in-process) entries so newly installed distributions are seen."""
        self._entries = {n: e for n, e in self._entries.items() if e.dist == "<in-process>"}
        self._conflicts.clear()
        self._failures.clear()
        self._discovered = False

    # -- registration ----------------------------------------------------------------------------------
    def register(self, name: str, obj: Any = None, *, replace: bool = False) -> Any:
        """Register ``obj`` under ``name`` in this process. Usable as a decorator when ``obj`` is omitted."""

        def _do(o: Any) -> Any:
            self._discover()
            if name in self._entries and not replace:
                old = self._entries[name]
                raise PluginError(
                    f"{self.kind} '{name}' is already provided by '{old.dist}' ({old.target}); "
                    f"pass replace=True to override it")
            self._entries[name] = Entry(name, self.kind, repr(o), "<in-process>", "-", o, True)
            self._conflicts.pop(name, None)
            return o

        return _do if obj is None else _do(obj)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    # -- lookup ----------------------------------------------------------------------------------------
    def names(self) -> List[str]:
        self._discover()
        return sorted(set(self._entries) | set(self._conflicts))

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def entries(self) -> List[Entry]:
        self._discover()
        return [self._entries[n] for n in sorted(self._entries)]

    def conflicts(self) -> Dict[str, List[Entry]]:
        self._discover()
        return dict(self._conflicts)

    def get(self, name: str) -> Any:
        """Import (once) and return the object registered as ``name``."""
        self._discover()
        if name in self._conflicts:
            claimants = ", ".join(f"'{e.dist}' ({e.target})" for e in self._conflicts[name])
            raise PluginError(f"{self.kind} '{name}' is claimed by several distributions: {claimants}. "
                              f"Uninstall all but one of them.")
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise unknown_name_of_any_length(self.kind, name, self.names())
        if not entry.loaded:
            try:
                ep = entry._ep  # type: ignore[attr-defined]
                entry.obj = self.load_entry(ep) if self.load_entry is not None else ep.load()
                entry.loaded = True
            except (Exception, SystemExit) as exc:  # any import-time failure of a plugin is reported, not raised
                failure = LoadFailure(self.kind, name, entry.dist, f"{type(exc).__name__}: {exc}",
                                      traceback.format_exc())
                self._failures[name] = failure
                raise PluginError(str(failure)) from exc
        return entry.obj

    def load_all(self) -> List[LoadFailure]:
        """Import every entry, returning the failures (the others stay usable)."""
        self._discover()
        for name in list(self._entries):
            try:
                self.get(name)
            except PluginError:
                pass
        return list(self._failures.values())

    def failures(self) -> List[LoadFailure]:
        return list(self._failures.values())


DATASETS = Registry("dataset", f"{GROUP_PREFIX}.datasets")
PARTITIONERS = Registry("partitioner", f"{GROUP_PREFIX}.partitioners")
MODELS = Registry("model", f"{GROUP_PREFIX}.models")
TRAINERS = Registry("trainer", f"{GROUP_PREFIX}.trainers")
AGGREGATORS = Registry("aggregator", f"{GROUP_PREFIX}.aggregators")
ALGORITHMS = Registry("algorithm", f"{GROUP_PREFIX}.algorithms")


TABLE_FILE_LIMIT = 1 << 20  # bytes: a table file is a page of TOML; a larger one is not a table


@dataclass(frozen=True)
class TableFile:
    """A paper's table as published by a plugin: a TOML data file, parsed (never executed). Its schema is checked
    by ``pflkit.core.results.tables`` when it is used."""

    origin: str  # "package:file.toml" for an entry point, the path for a file given on the command line
    data: Dict[str, Any]

    @property
    def description(self) -> str:
        paper = self.data.get("paper") if isinstance(self.data.get("paper"), dict) else {}
        title, number = paper.get("title", "?"), paper.get("table", "?")
        return f"{title}, Table {number}: {paper.get('caption', '')}".rstrip(": ")


def parse_table_text(text: str, origin: str) -> TableFile:
    """A table file's text -> TableFile (TOML; a key given twice is refused by TOML itself)."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        data = tomllib.loads(text)
    except Exception as exc:
        raise PluginError(f"table file {origin} is not valid TOML: {exc}") from None
    return TableFile(origin, data)


def load_table_entry(ep: Any) -> TableFile:
    """An entry point of ``pflkit.tables``: ``name = package:file.toml`` names a data file inside ``package``."""
    import importlib.resources

    if not ep.attr:
        raise PluginError(f"table entry point {ep.value!r}: expected package:file.toml")
    resource = importlib.resources.files(ep.module).joinpath(ep.attr)
    with resource.open("rb") as fh:  # read at most one byte past the cap: a huge (or endless) file is never read whole
        data = fh.read(TABLE_FILE_LIMIT + 1)
    if len(data) > TABLE_FILE_LIMIT:
        raise PluginError(f"table file {ep.value} is over {TABLE_FILE_LIMIT} bytes; a table file is at most "
                          f"{TABLE_FILE_LIMIT}")
    return parse_table_text(data.decode("utf-8"), ep.value)


TABLES = Registry("table", f"{GROUP_PREFIX}.tables", load_entry=load_table_entry)

ALL_REGISTRIES: Dict[str, Registry] = {
    "datasets": DATASETS, "partitioners": PARTITIONERS, "models": MODELS,
    "trainers": TRAINERS, "aggregators": AGGREGATORS, "algorithms": ALGORITHMS,
    "tables": TABLES,
}


NAME_LIMIT = 100  # characters shown of a name that no registry knows (a 300-character --plugin stays one line)


def unknown_name_of_any_length(kind: str, name: Any, options: Iterable[str]) -> UnknownNameError:
    """``unknown_name``, with a name longer than NAME_LIMIT (or not text) cut short in the message and no
    did-you-mean search (difflib is quadratic in the name's length)."""
    text = str(name)
    if len(text) <= NAME_LIMIT:
        return unknown_name(kind, text, options)
    opts = sorted(options)
    return UnknownNameError(f"unknown {kind} '{text[:40]}...' ({len(text)} characters; names are short). "
                            f"Available: {', '.join(opts) if opts else '(none installed)'}")


def refresh_all() -> None:
    for reg in ALL_REGISTRIES.values():
        reg.refresh()


def describe(obj: Any) -> str:
    """The first paragraph of an object's description or docstring, as one line (``fl list`` cuts it to the width,
    marked '...'; ``fl show`` prints it whole). A paragraph, not a line, so a sentence that wraps onto the next line
    is never cut in the middle; a first paragraph that ends in ':' introduces the next and takes it along."""
    doc = getattr(obj, "description", None) or getattr(obj, "__doc__", None) or ""
    if not isinstance(doc, str):
        return ""
    paragraphs, current = [], []
    for line in doc.strip().splitlines():
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    text = paragraphs[0] if paragraphs else ""
    for more in paragraphs[1:2]:
        if text.endswith(":"):
            text = f"{text} {more}"
    return text


Loader = Callable[..., Any]
