"""MkDocs hook: one page per algorithm plugin, generated at build time, so the site cannot drift from the plugins.

Each page is the plugin's own ``plugins/<dir>/README.md`` (its links rewritten to work inside the site) followed by
what ``fl show NAME`` prints for every algorithm the plugin registers (``pflkit.algorithms`` entry points in its
``setup.cfg``). ``algorithms/index.md`` lists them all. Nothing here is written to the repository: the pages exist
only in the build (``File.generated``), and images under ``plugins/<dir>/docs/`` are copied from where they are.

The plugins must be installed (``pip install ./plugins/*/``), as for the test suite: ``fl show`` reads the
installed entry points.
"""
from __future__ import annotations

import configparser
import importlib.metadata
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
SECTION = "Algorithms"

# The README's sections moved into these pages (same headings, so the same anchors): a plugin README's link to
# ../../README.md#anchor is sent to the page that now holds that section.
README_ANCHORS = {
    "reproducibility": "reproducibility.md#reproducibility",
    "comparing-algorithms": "comparing.md#comparing-algorithms",
    "evaluation-time-adaptation": "evaluation.md#evaluation-time-adaptation",
    "many-clients-declared-state-and-memory": "scaling.md#many-clients-declared-state-and-memory",
    "threads": "performance.md#threads",
    "round-protocol": "concepts.md#round-protocol",
    "per-client-state": "concepts.md#per-client-state",
    "writing-a-plugin": "writing-plugins.md#writing-a-plugin",
    "reusing-a-partition": "datasets.md#reusing-a-partition",
    "checkpoints-and-resuming": "checkpoints.md#checkpoints-and-resuming",
}


def plugin_algorithms() -> Dict[str, List[str]]:
    """plugin folder name -> the algorithm names its setup.cfg registers (folders without a README are skipped)."""
    out: Dict[str, List[str]] = {}
    for cfg_path in sorted(PLUGINS.glob("*/setup.cfg")):
        folder = cfg_path.parent
        if not (folder / "README.md").is_file():
            continue
        cfg = configparser.ConfigParser()
        cfg.read(cfg_path, encoding="utf-8")
        group = cfg.get("options.entry_points", "pflkit.algorithms", fallback="")
        names = [line.split("=", 1)[0].strip() for line in group.strip().splitlines() if "=" in line]
        if names:
            out[folder.name] = names
    return out


def _fl_group():
    """The click group behind the installed ``fl`` console script (wherever the core keeps it)."""
    (ep,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "fl"]
    return sys.modules[ep.load().__module__].cli


def fl_show(name: str) -> str:
    from click.testing import CliRunner

    result = CliRunner().invoke(_fl_group(), ["show", name], prog_name="fl")
    if result.exit_code != 0:
        raise RuntimeError(f"`fl show {name}` failed (exit {result.exit_code}): {result.output.strip()[-500:]}")
    return result.output.rstrip()


def _rewrite_link(target: str, folder: str, known: set) -> str:
    """A link of plugins/<folder>/README.md, as seen from the page algorithms/<folder>.md."""
    if re.match(r"^[a-z]+:|^#", target):
        return target
    path, _, anchor = target.partition("#")
    if path in ("", "README.md"):
        return f"#{anchor}" if anchor else f"{folder}.md"
    if path == "../../README.md":
        if anchor in README_ANCHORS:
            return "../" + README_ANCHORS[anchor]
        return "../index.md" + (f"#{anchor}" if anchor else "")
    m = re.match(r"^\.\./([a-z0-9_]+)/README\.md$", path)
    if m and m.group(1) in known:
        return f"{m.group(1)}.md" + (f"#{anchor}" if anchor else "")
    if path.startswith("../../docs/"):
        return "../" + path[len("../../docs/"):] + (f"#{anchor}" if anchor else "")
    if path.startswith("docs/"):
        return f"{folder}/{path[len('docs/'):]}" + (f"#{anchor}" if anchor else "")
    return target  # left as it is: mkdocs --strict reports it if it leads nowhere


LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


def page_markdown(folder: str, names: List[str], known: set) -> str:
    readme = (PLUGINS / folder / "README.md").read_text(encoding="utf-8")
    body = LINK.sub(lambda m: f"{m.group(1)}({_rewrite_link(m.group(2), folder, known)})", readme)
    parts = [body.rstrip(), "",
             f"## Options: `fl show`", "",
             f"Generated when the site is built, from the installed plugin `pflkit-{folder}` (source: "
             f"`plugins/{folder}/`).", ""]
    for name in names:
        parts += [f"```console", f"$ fl show {name}", fl_show(name), "```", ""]
    return "\n".join(parts)


def index_markdown(plugins: Dict[str, List[str]]) -> str:
    from pflkit.core import ALGORITHMS

    lines = ["# Algorithms", "",
             "One page per algorithm plugin, generated when the site is built from the plugin's README and "
             "`fl show NAME`, so the two cannot drift. Each plugin is a separate package under `plugins/<name>/` "
             "(distribution `pflkit-<name>`); `fl list algorithms` shows those installed.", "",
             "| algorithm | page | what it is |", "|---|---|---|"]
    for folder, names in plugins.items():
        for name in names:
            desc = str(getattr(ALGORITHMS.get(name), "description", "")).replace("|", "\\|")
            lines.append(f"| `{name}` | [{folder}]({folder}.md) | {desc} |")
    return "\n".join(lines) + "\n"


def _api_search_path() -> str:
    """A folder holding ``pflkit/core`` as a link to the installed ``pflkit.core``, for mkdocstrings.

    ``pflkit.core`` is the repository's folder ``core/`` (setup.cfg's ``package_dir``): an editable install maps
    the name with an import hook that griffe's static finder cannot follow, and a plain install has it in
    site-packages. The link makes both look like an ordinary ``pflkit/core`` package, and documents what is
    installed, as the CLI reference does.
    """
    import importlib.util

    spec = importlib.util.find_spec("pflkit.core")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pflkit is not installed: pip install \".[test]\" ./plugins/*/")
    holder = Path(tempfile.mkdtemp(prefix="pflkit-docs-api-"))
    (holder / "pflkit").mkdir()
    for package in ("core", "models", "datasets"):  # models/datasets: the bundled contracts pflkit.core re-exports
        found = importlib.util.find_spec(f"pflkit.{package}")
        if found is not None and found.submodule_search_locations:
            target = Path(list(found.submodule_search_locations)[0]).resolve()
            (holder / "pflkit" / package).symlink_to(target, target_is_directory=True)
    _TEMPORARY.append(holder)
    return str(holder)


_TEMPORARY: List[Path] = []


def on_shutdown(**kwargs):
    for holder in _TEMPORARY:
        shutil.rmtree(holder, ignore_errors=True)  # removes the link, never what it points at
    _TEMPORARY.clear()


@event_priority(100)  # before mkdocstrings' own on_config, which builds its handlers
def on_config(config, **kwargs):
    """Point mkdocstrings at the installed pflkit.core; put the generated pages into the navigation."""
    python = config["plugins"]["mkdocstrings"].config["handlers"].setdefault("python", {})
    python["paths"] = [_api_search_path()]
    plugins = plugin_algorithms()
    entries = [{"Overview": "algorithms/index.md"}] + [{f: f"algorithms/{f}.md"} for f in plugins]
    for item in config["nav"]:
        if isinstance(item, dict) and SECTION in item:
            item[SECTION] = entries
            break
    else:
        config["nav"].append({SECTION: entries})
    return config


API_MARKER = "<!-- public-api -->"


def api_markdown() -> str:
    """One mkdocstrings block per name of ``pflkit.core.__all__``, grouped by the module that defines it.

    ``pflkit.core`` exports its names lazily (a module ``__getattr__``), which static analysis cannot see, so the
    page documents each name where it is defined, from the one table of exports (``pflkit.core._EXPORTS``).
    """
    from pflkit import core

    by_module: Dict[str, List[str]] = {}
    for name in core.__all__:
        module = core._EXPORTS[name]
        by_module.setdefault("pflkit.core" + module if module.startswith(".") else module, []).append(name)
    out: List[str] = []
    for module, names in by_module.items():
        out.append(f"## {', '.join(f'`{n}`' for n in names)}\n\nDefined in `{module}`.\n")
        for name in names:
            out.append(f"::: {module}.{name}\n    options:\n      show_root_full_path: false\n      heading_level: 3\n")
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri == "api.md":
        if API_MARKER not in markdown:
            raise RuntimeError(f"docs/api.md lacks the {API_MARKER} marker where the API reference goes")
        return markdown.replace(API_MARKER, api_markdown())
    return markdown


def on_files(files, config, **kwargs):
    plugins = plugin_algorithms()
    known = set(plugins)
    files.append(File.generated(config, "algorithms/index.md", content=index_markdown(plugins)))
    for folder, names in plugins.items():
        files.append(File.generated(config, f"algorithms/{folder}.md", content=page_markdown(folder, names, known)))
        for image in sorted((PLUGINS / folder / "docs").glob("*")):
            if image.suffix.lower() in (".png", ".svg", ".jpg", ".jpeg", ".gif"):
                files.append(File.generated(config, f"algorithms/{folder}/{image.name}", abs_src_path=str(image)))
    return files
