"""The README: its set-up blocks for .ci/run, its length, its printed outputs and its fl commands.

The quick start command is read from the README's ``ci:install`` block (the part after ``&&``: ``fl run --plugin
fedavg``); its printed summary is shown, marked ``<!-- output-of: ... -->``, in docs/getting-started.md, and
tests/test_docs.py compares it with a fresh run. Here: every output block of the README itself (``fl run --plugin
fedcp``) equals a fresh run's result lines (tests/doccheck.py says which lines and why), and every ``fl`` command
the README shows parses and resolves. Editing a number in the README, or a change of the code that moves a
number, fails this test; the fix is to paste the new output into the README.

One run of the README's FedCP example: about 25-40 s of CPU time (30 rounds, 20 clients, the 8x8 digits).
"""
import re
import shlex

import pytest

import doccheck

README_MAX_LINES = 220  # issue 30: "a README of at most about 200 lines"; the details live on the site


def quickstart_command():
    lines, blocks = doccheck.fenced_blocks(doccheck.README.read_text(encoding="utf-8"))
    marker = next(i for i, line in enumerate(lines) if "<!-- ci:install -->" in line)
    install = next(body for start, _, body in blocks if start > marker)[0]
    assert "&&" in install, f"the ci:install block no longer ends with the quick-start run: {install!r}"
    return install.split("&&", 1)[1].strip()


def test_ci_blocks_are_there():
    """.ci/run reads the first line of the fenced block after each marker."""
    lines, blocks = doccheck.fenced_blocks(doccheck.README.read_text(encoding="utf-8"))
    for marker, starts in (("<!-- ci:install -->", "pip install "), ("<!-- ci:test -->", "python -m pytest")):
        at = next(i for i, line in enumerate(lines) if marker in line)
        body = next(body for start, _, body in blocks if start > at)
        assert body[0].startswith(starts), (marker, body[0])
    assert shlex.split(quickstart_command())[:2] == ["fl", "run"]


def test_quickstart_output_is_shown_and_checked():
    """The ci:install run's summary is one of the checked output blocks (README or a docs page)."""
    command = quickstart_command()
    shown = [cmd for path in doccheck.documents() for cmd, _ in doccheck.output_blocks(path)]
    assert command in shown, f"no <!-- output-of: {command} --> block in the README or docs/*.md"


def test_readme_is_short():
    n = len(doccheck.README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_readme_links_to_docs_pages_exist():
    text = doccheck.README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(((?:docs|plugins)/[^)#\s]*)", text)
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not (doccheck.ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_output_blocks_are_parsed():
    blocks = doccheck.output_blocks(doccheck.README)
    assert blocks, "the README shows no <!-- output-of: ... --> block"
    for command, block in blocks:
        expected = doccheck.result_lines(block)
        # the block shows at least these results; if the parser lost them the comparison would be vacuous
        for key in ("algorithm", "dataset / clients", "rounds completed", "client failures",
                    "communication up / down"):
            assert key in expected, f"README block of `{command}` lacks '{key}'"
        assert any(k.startswith("final accuracy, uniform") for k in expected)
        assert any(k.startswith("best accuracy, uniform") for k in expected)


# the README's FedCP example is 30 rounds of FedCP (about 100 s of the CI's 20 minutes under a parallel test run):
# checked with PFLKIT_SLOW_TESTS=1, like the other whole-run equalities; the blocks are parsed in every run above


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow)
                                     for c in sorted({c for c, _ in doccheck.output_blocks(doccheck.README)})])
def test_readme_output_matches_a_fresh_run(command, tmp_path):
    printed = doccheck.run_fl(command, tmp_path)
    for cmd, block in doccheck.output_blocks(doccheck.README):
        if cmd == command:
            doccheck.check_output_block("README.md", command, block, printed)


def test_readme_fl_commands_parse_and_resolve():
    made = tuple(doccheck.scaffolded_names(doccheck.README))
    commands = list(doccheck.fl_commands(doccheck.README))
    assert len(commands) >= 3, commands
    for line, command in commands:
        doccheck.check_command(f"README.md:{line}", command, made)
