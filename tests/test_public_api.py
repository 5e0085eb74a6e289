"""One public API (issue 30): a plugin imports the core only through ``pflkit.core`` and, in its tests,
``pflkit.core.testing``; the core's modules behind them move freely. Checked on every built-in plugin (its package
and its tests) and on every skeleton ``fl new-plugin`` generates.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from click.testing import CliRunner

import pflkit.core
import pflkit.core.testing
from pflkit.core.testing import cli

REPO = Path(__file__).resolve().parents[1]
PUBLIC = {"pflkit.core", "pflkit.core.testing"}
KINDS = ["algorithm", "dataset", "partitioner", "model"]


def plugin_files() -> List[Path]:
    files = [p for pattern in ("plugins/*/pflkit_*/**/*.py", "plugins/*/tests/**/*.py")
             for p in REPO.glob(pattern)]
    return sorted(set(files))


def problems_in(path: Path, root: Path) -> List[str]:
    """Every import of pflkit that is not the public API, and every name the public API does not have."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "pflkit" and a.name not in PUBLIC:
                    out.append(f"{rel}:{node.lineno}: import {a.name}: import only pflkit.core and "
                               f"pflkit.core.testing")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "pflkit":
            if node.module == "pflkit":
                bad = [a.name for a in node.names if a.name != "core"]
                if bad:
                    out.append(f"{rel}:{node.lineno}: from pflkit import {', '.join(bad)}: import only pflkit.core "
                               f"and pflkit.core.testing")
                continue
            if node.module not in PUBLIC:
                names = ", ".join(a.name for a in node.names)
                out.append(f"{rel}:{node.lineno}: from {node.module} import {names}: a core internal; import it "
                           f"from pflkit.core (or, in tests, pflkit.core.testing)")
                continue
            module = pflkit.core if node.module == "pflkit.core" else pflkit.core.testing
            for a in node.names:
                if a.name not in module.__all__:
                    out.append(f"{rel}:{node.lineno}: {a.name} is not in {node.module}.__all__")
                elif not hasattr(module, a.name):
                    out.append(f"{rel}:{node.lineno}: {node.module} has no {a.name}")
    return out


def test_the_public_api_resolves_and_is_imported_lazily():
    for name in pflkit.core.__all__:
        assert getattr(pflkit.core, name) is not None, name
    assert len(set(pflkit.core.__all__)) == len(pflkit.core.__all__)
    # `import pflkit.core` stays cheap: the names above are imported on first use (torch only then)
    code = "import sys, pflkit.core; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pflkit.core.no_such_name  # noqa: B018


def test_every_builtin_plugin_imports_only_the_public_api():
    files = plugin_files()
    assert len(files) > 60  # every plugin's package and tests were found
    problems = [p for f in files for p in problems_in(f, REPO)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", KINDS)
def test_every_scaffold_imports_only_the_public_api(tmp_path, kind):
    name = f"api_{kind}_x"
    res = CliRunner().invoke(cli, ["new-plugin", name, "--kind", kind, "--dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / f"pflkit-{name.replace('_', '-')}").rglob("*.py"))
    assert len(files) >= 2
    imported = [n for f in files for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pflkit")]
    assert imported, "a skeleton that imports nothing from pflkit checks nothing"
    problems = [p for f in files for p in problems_in(f, tmp_path)]
    assert not problems, "\n".join(problems)


def test_the_checker_names_an_internal_import(tmp_path):
    bad = tmp_path / "pflkit_bad" / "__init__.py"
    bad.parent.mkdir()
    bad.write_text("from pflkit.core.api.params import positive\nfrom pflkit.core import Nope\n"
                   "import pflkit.models.base\nfrom pflkit import datasets\nfrom pflkit.core.testing import cli\n")
    problems = problems_in(bad, tmp_path)
    assert problems == [
        "pflkit_bad/__init__.py:1: from pflkit.core.api.params import positive: a core internal; import it from "
        "pflkit.core (or, in tests, pflkit.core.testing)",
        "pflkit_bad/__init__.py:2: Nope is not in pflkit.core.__all__",
        "pflkit_bad/__init__.py:3: import pflkit.models.base: import only pflkit.core and pflkit.core.testing",
        "pflkit_bad/__init__.py:4: from pflkit import datasets: import only pflkit.core and pflkit.core.testing",
    ]
