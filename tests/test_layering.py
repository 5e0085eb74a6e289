"""The core's folders are layers, and each imports only the layers below it (issue 30).

``LAYERS`` is the one list of the order, bottom to top: a module of a layer may import its own layer and any layer
below it, never one above, so no two layers import each other (a circle between layers always has an upward edge).
Every import counts: module-level, inside functions and under ``TYPE_CHECKING`` alike, because a deferred import is
still a dependency. Inside a layer, module-level imports must not form a circle either.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

CORE = Path(__file__).resolve().parents[1] / "core"

# bottom to top: a top-level folder (a layer) or module of core/
LAYERS = [
    "cli_start",    # the fl command's Ctrl-C handling during start-up: imports nothing from the core
    "common",       # errors, strict JSON, safe files, seeds, threads, call timer
    "api",          # the plugin API: algorithm, client, server, protocol, params, task, training, state, registry...
    "data",         # building the federated data set
    "storage",      # the run directory: what is written into it and read back from it
    "engine",       # configuring, starting, resuming and running a simulation
    "results",      # reading and presenting finished runs
    "distributed",  # the multi-process runner (torchrun / --workers)
    "cli",          # the fl command
    "testing",      # helpers for plugin tests
    "__init__",     # the public API (pflkit.core)
]


def unit_of(module: str) -> str:
    """The layer of a dotted module below pflkit.core ('' is the package itself)."""
    return module.split(".")[0] if module else "__init__"


def core_modules(core: Path) -> Dict[str, Tuple[Path, bool]]:
    """dotted name below pflkit.core -> (file, is a package)."""
    out = {}
    for p in sorted(core.rglob("*.py")):
        parts = list(p.relative_to(core).with_suffix("").parts)
        if parts[-1] == "__init__":
            out[".".join(parts[:-1])] = (p, True)
        else:
            out[".".join(parts)] = (p, False)
    return out


def imports_of(name: str, path: Path, is_pkg: bool, modules: Dict) -> List[Tuple[int, str, bool]]:
    """(line, imported core module, at module level) for every import of a core module in one file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    package = name if is_pkg else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            elif node.module == "pflkit.core" or (node.module or "").startswith("pflkit.core."):
                base = node.module[len("pflkit.core"):].lstrip(".")
            else:
                continue
            for alias in node.names:  # `from pkg import module` depends on that module
                sub = f"{base}.{alias.name}".lstrip(".")
                targets.append(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            targets = [a.name[len("pflkit.core"):].lstrip(".") for a in node.names
                       if a.name == "pflkit.core" or a.name.startswith("pflkit.core.")]
        for t in dict.fromkeys(targets):
            found.append((node.lineno, t, id(node) in top))
    return found


def violations(core: Path, layers: List[str]) -> List[str]:
    modules = core_modules(core)
    rank = {u: i for i, u in enumerate(layers)}
    problems = []
    graph: Dict[str, Set[str]] = {}
    for name, (path, is_pkg) in modules.items():
        src = unit_of(name)
        rel = path.relative_to(core.parent)
        if src not in rank:
            problems.append(f"{rel}: '{src}' is in no layer: add it to LAYERS in tests/test_layering.py (or move "
                            f"it into a layer folder)")
            continue
        for line, target, at_top in imports_of(name, path, is_pkg, modules):
            dst = unit_of(target)
            if dst not in rank:
                continue  # reported for its own file
            if rank[dst] > rank[src]:
                full = "pflkit.core" + (f".{target}" if target else "")
                problems.append(f"{rel}:{line}: imports {full} ({dst}), a layer above {src}; "
                                f"layers import downwards only: {' < '.join(layers)}")
            if at_top and dst == src and target != name:
                graph.setdefault(name, set()).add(target)
    cycle = find_cycle(graph)
    if cycle:
        problems.append("module-level imports in a circle: " + " -> ".join(f"pflkit.core.{m}" for m in cycle))
    return problems


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_core_imports_run_downwards_only():
    problems = violations(CORE, LAYERS)
    assert not problems, "\n".join(problems)


def test_every_layer_folder_says_what_it_owns():
    folders = sorted(p.parent.name for p in CORE.glob("*/__init__.py"))
    assert set(folders) <= set(LAYERS), f"folders not in LAYERS: {set(folders) - set(LAYERS)}"
    for folder in folders:
        doc = ast.get_docstring(ast.parse((CORE / folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"core/{folder}/__init__.py needs a docstring: what the layer owns"
    top = sorted(p.stem for p in CORE.glob("*.py"))
    assert top == ["__init__", "cli_start", "testing"], f"only the public API and cross-cutting modules stay at " \
                                                         f"the top of core/: {top}"


def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    core = tmp_path / "core"
    for rel, text in files.items():
        (core / rel).parent.mkdir(parents=True, exist_ok=True)
        (core / rel).write_text(text)
    return core


def test_an_upward_import_is_named_with_its_file_and_line(tmp_path):
    core = _tree(tmp_path, {
        "__init__.py": "", "common/__init__.py": "", "engine/__init__.py": "",
        "common/a.py": "import os\n\ndef f():\n    from ..engine.b import g  # deferred, still a dependency\n",
        "engine/b.py": "from ..common.a import f\n\ndef g():\n    return f\n",
    })
    problems = violations(core, ["common", "engine", "__init__"])
    assert len(problems) == 1
    assert problems[0].startswith("core/common/a.py:4: imports pflkit.core.engine.b (engine), a layer above "
                                  "common")


def test_absolute_imports_module_imports_and_unlisted_folders_are_caught(tmp_path):
    core = _tree(tmp_path, {
        "__init__.py": "", "common/__init__.py": "", "api/__init__.py": "", "extra/__init__.py": "",
        "common/a.py": "from pflkit.core.api import b\n",
        "api/b.py": "import pflkit.core.common.a\nfrom pflkit.core import Simulation\n",
    })
    problems = violations(core, ["common", "api", "__init__"])
    assert any(p.startswith("core/common/a.py:1: imports pflkit.core.api.b (api)") for p in problems), problems
    assert any(p.startswith("core/api/b.py:2: imports pflkit.core (__init__), a layer above api") for p in problems)
    assert any("core/extra/__init__.py: 'extra' is in no layer" in p for p in problems), problems
    assert not any(p.startswith("core/api/b.py:1") for p in problems)  # downwards is fine


def test_a_circle_inside_a_layer_is_caught(tmp_path):
    core = _tree(tmp_path, {
        "__init__.py": "", "api/__init__.py": "",
        "api/x.py": "from .y import Y\n", "api/y.py": "from .x import X\n",
    })
    problems = violations(core, ["api", "__init__"])
    assert problems == ["module-level imports in a circle: pflkit.core.api.x -> pflkit.core.api.y -> "
                        "pflkit.core.api.x"]
