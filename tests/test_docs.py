"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (a dead link, a missing
anchor or page, a page left out of the navigation fails), it has a generated page for every algorithm plugin, its
output blocks equal fresh runs, and every ``fl`` command on its pages parses and resolves (tests/doccheck.py).

The build takes about 30 s of CPU (it imports torch and runs ``fl show`` for every algorithm).
"""
import re
import configparser
import shutil
import subprocess
import sys

import pytest

import doccheck

ROOT = doccheck.ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once into a temporary folder (never into the checkout)."""
    if shutil.which("mkdocs") is None and subprocess.run([sys.executable, "-c", "import mkdocs"]).returncode:
        pytest.fail('mkdocs is not installed: pip install ".[test]" ./plugins/*/ (the test extra brings it)')
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return out


def plugin_algorithms():
    out = {}
    for cfg_path in sorted((ROOT / "plugins").glob("*/setup.cfg")):
        cfg = configparser.ConfigParser()
        cfg.read(cfg_path, encoding="utf-8")
        group = cfg.get("options.entry_points", "pflkit.algorithms", fallback="")
        out[cfg_path.parent.name] = [ln.split("=", 1)[0].strip() for ln in group.strip().splitlines() if "=" in ln]
    return out


def test_site_builds_strict(site):
    for page in ("index.html", "getting-started/index.html", "evaluation/index.html", "cli/index.html",
                 "api/index.html", "algorithms/index.html"):
        assert (site / page).is_file(), page


def test_every_algorithm_plugin_has_a_generated_page(site):
    plugins = plugin_algorithms()
    assert len(plugins) >= 30, sorted(plugins)
    index = (site / "algorithms" / "index.html").read_text(encoding="utf-8")
    for folder, names in plugins.items():
        page = site / "algorithms" / folder / "index.html"
        assert page.is_file(), f"no generated page for plugins/{folder}"
        html = page.read_text(encoding="utf-8")
        assert names, f"plugins/{folder} registers no algorithm"
        for name in names:
            assert f"algorithm {name}:" in html, f"`fl show {name}` output missing from its page"
        assert f'href="{folder}/"' in index, f"algorithms/index lacks {folder}"
    assert not (ROOT / "docs" / "algorithms").exists(), "generated pages must not be committed"


def test_cli_and_api_references_are_generated(site):
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("fl run", "fl compare", "fl show", "fl data"):
        assert command in cli, command
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    from pflkit import core
    documented = set(re.findall(r'id="pflkit\.[\w.]+\.(\w+)"', api))
    undocumented = [name for name in core.__all__ if name not in documented]
    assert not undocumented, f"public API names missing from the API reference: {undocumented}"


def test_docs_output_blocks_are_marked():
    shown = {cmd for path in doccheck.documents() for cmd, _ in doccheck.output_blocks(path)}
    assert "fl run --plugin fedavg" in shown


@pytest.mark.parametrize("command", sorted({c for p in doccheck.documents()[1:] for c, _ in doccheck.output_blocks(p)}))
def test_docs_output_matches_a_fresh_run(command, tmp_path):
    printed = doccheck.run_fl(command, tmp_path)
    for path in doccheck.documents()[1:]:
        for cmd, block in doccheck.output_blocks(path):
            if cmd == command:
                doccheck.check_output_block(path.name, command, block, printed)


@pytest.mark.parametrize("page", [p.name for p in doccheck.documents()[1:]])
def test_docs_fl_commands_parse_and_resolve(page):
    path = ROOT / "docs" / page
    made = tuple(doccheck.scaffolded_names(path))
    for line, command in doccheck.fl_commands(path):
        doccheck.check_command(f"docs/{page}:{line}", command, made)


@pytest.mark.parametrize("command, complaint", [
    ("fl run --plugin fedavg --set train.lrr=0.1", "train.lrr"),
    ("fl run --plugin fedavgg", "fedavgg"),
    ("fl run --plugn fedavg", "--plugn"),
    ("fl compare --plugins fedavg,fedprox --seeds 0 --set fedprox:trainer.muu=1 --out x", "muu"),
    ("fl run --plugin fedavg --set train.lr=-1", "train.lr"),
])
def test_the_command_check_catches_a_wrong_command(command, complaint):
    with pytest.raises(AssertionError, match=complaint.replace("-", r"\-")):
        doccheck.check_command("test", command)


def test_commands_are_found_in_continued_lines_and_variables(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('```bash\nS="--set rounds=2 \\\n   --set train.lr=0.1"\n'
                    'OMP_NUM_THREADS=1 fl run --plugin fedavg $S   # comment\n'
                    'fl data install fmnist && fl run --plugin local \\\n  --set rounds=3\n```\n', encoding="utf-8")
    found = [c for _, c in doccheck.fl_commands(page)]
    assert found == ["fl run --plugin fedavg --set rounds=2 --set train.lr=0.1", "fl data install fmnist",
                     "fl run --plugin local --set rounds=3"], found


def test_plugin_readme_links_resolve_on_github_too():
    """A plugin README is read on GitHub as well as on the site: every relative link names a file that exists."""
    dead = []
    for readme in sorted((ROOT / "plugins").glob("*/README.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8")):
            path = target.partition("#")[0]
            if path and not re.match(r"^[a-z]+:", path) and not (readme.parent / path).exists():
                dead.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not dead, dead
