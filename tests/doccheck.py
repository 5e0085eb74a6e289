"""Checks of the commands and outputs shown in the README and the documentation pages (one source of truth for
tests/test_readme.py and tests/test_docs.py).

Two kinds of check:

* **Outputs.** A fenced block right after a ``<!-- output-of: COMMAND -->`` line is what ``COMMAND`` prints. The
  command is run as a new user would, in an empty directory; every line of the block that carries a result
  (algorithm, dataset and clients, rounds, every accuracy with its round, min/max client, communication,
  failures) must equal the printed line, and every printed result line must be in the block, in order. Paths,
  timings and the checkpoint size are not compared (they vary).
* **Commands.** Every ``fl ...`` command in a ``bash`` block is parsed by the ``fl`` command's own click options,
  and for ``fl run`` / ``fl compare`` its ``--plugin(s)`` and ``--set`` values are resolved into a configuration
  exactly as a run would (unknown key, unknown algorithm, invalid value: the test fails naming the page and the
  command). Commands that name files the page makes first or placeholders (``NAME``, ``RUN_DIR``, ``$VAR``,
  ``...``) are parsed but their configuration is not resolved.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
KEY_VALUE = re.compile(r"^(\S.*?)\s{2,}(\S.*)$")
NOT_COMPARED = ("checkpoint", "metrics:", "watch in TensorBoard")  # paths and sizes, not results
OUTPUT_OF = re.compile(r"^<!--\s*output-of:\s*(.+?)\s*-->\s*$")


def documents() -> List[Path]:
    """The README and every hand-written page of the site (generated pages have no source file)."""
    return [README, *sorted(p for p in DOCS.glob("*.md"))]


def fenced_blocks(text: str) -> Tuple[List[str], List[Tuple[int, str, List[str]]]]:
    """(lines, [(line index of the opening fence, info string, lines inside)]) of every fenced block."""
    lines, blocks, start, info = text.splitlines(), [], None, ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("```"):
            if start is None:
                start, info = i, stripped[3:].strip()
            else:
                blocks.append((start, info, lines[start + 1:i]))
                start = None
    return lines, blocks


# -- outputs -------------------------------------------------------------------------------------------------
def output_blocks(path: Path) -> List[Tuple[str, List[str]]]:
    """(command, block lines) for every block marked ``<!-- output-of: COMMAND -->`` in ``path``."""
    lines, blocks = fenced_blocks(path.read_text(encoding="utf-8"))
    out = []
    for start, _, body in blocks:
        m = OUTPUT_OF.match(lines[start - 1]) if start else None
        if m:
            out.append((m.group(1), body))
    return out


def result_lines(lines) -> Dict[str, str]:
    """key -> value of the summary lines that carry results."""
    out = {}
    for line in lines:
        m = KEY_VALUE.match(line.rstrip())
        if m and not m.group(1).startswith(NOT_COMPARED):
            out[m.group(1)] = m.group(2)
    return out


def result_keys(lines) -> List[str]:
    """The result lines' keys in order, repeats included (result_lines would hide a duplicated line)."""
    return [m.group(1) for m in map(KEY_VALUE.match, (line.rstrip() for line in lines))
            if m and not m.group(1).startswith(NOT_COMPARED)]


def run_fl(command: str, cwd: Path, timeout: int = 900) -> str:
    """Run ``fl ...`` as the checkout's module, one torch thread (the fl default the blocks were made with)."""
    argv = shlex.split(command)
    assert argv[0] == "fl", f"an output-of command must be an fl command: {command!r}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pflkit.core.cli", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def check_output_block(where: str, command: str, block: List[str], printed_text: str) -> None:
    expected = result_lines(block)
    assert expected, f"{where}: the output block of `{command}` holds no result line"
    start = printed_text.index("\nalgorithm ") + 1  # the summary table, after the per-round lines
    printed_lines = printed_text[start:].splitlines()
    printed = result_lines(printed_lines)
    mismatched = {k: (v, printed.get(k, "<not printed>")) for k, v in expected.items() if printed.get(k) != v}
    assert not mismatched, f"{where}: the block (left) differs from what `{command}` printed (right): {mismatched}"
    missing = sorted(set(printed) - set(expected))
    assert not missing, f"{where}: printed result lines missing from the block of `{command}`: {missing}"
    assert result_keys(block) == result_keys(printed_lines), \
        f"{where}: the block's result lines are not the printed ones, in the printed order (a repeated line?)"


# -- commands ------------------------------------------------------------------------------------------------
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
PLACEHOLDER = re.compile(r"\$|\.\.\.|\b[A-Z][A-Z_]{2,}\b|\[|<|~")


def fl_commands(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, command) of every ``fl`` command in the shell blocks of ``path``."""
    lines, blocks = fenced_blocks(path.read_text(encoding="utf-8"))
    for start, info, body in blocks:
        if info.split(" ")[0] not in SHELL_BLOCKS:
            continue
        logical, first, variables = "", None, {}
        for offset, raw in enumerate(body, start=start + 2):
            line = raw.strip()
            line = line[2:] if line.startswith("$ ") else line
            if first is None:
                first = offset
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            assigned = re.match(r'^([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"\s*$', logical.strip())
            if assigned:  # S="--set ..." then fl ... $S: the command as the shell runs it
                variables[assigned.group(1)] = " ".join(assigned.group(2).split())
            logical = re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*)\b",
                             lambda m: variables.get(m.group(1), m.group(0)), logical)
            for segment in re.split(r"&&|;|\|", _strip_comment(logical)):
                words = segment.split()
                while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                    words.pop(0)
                if words and words[0] == "fl":
                    yield first, " ".join(words)
            logical, first = "", None


def _strip_comment(line: str) -> str:
    out, quote = [], None
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            break
        out.append(ch)
    return "".join(out)


def _fl_group():
    from pflkit.core.cli.main import cli
    return cli


def _resolve(plugin: str, sets: List[str]) -> None:
    from pflkit.core.engine.config import parse_sets, resolve
    resolve([parse_sets(sets)], algorithm=plugin)


def scaffolded_names(path: Path) -> List[str]:
    """Names the page itself creates with ``fl new-plugin NAME`` (they exist once the reader has run that)."""
    return [shlex.split(c)[2] for _, c in fl_commands(path) if c.startswith("fl new-plugin ")]


def check_command(where: str, command: str, made: tuple = ()) -> None:
    """Parse ``command`` with the fl command's click options; resolve the configuration of run and compare.

    ``made``: names the page creates first (``scaffolded_names``); a command using one is parsed only."""
    import click

    argv = shlex.split(command)[1:]
    group = _fl_group()
    try:
        ctx = group.make_context("fl", list(argv), resilient_parsing=True)
        name, sub, rest = group.resolve_command(ctx, ctx.protected_args + ctx.args)
        while isinstance(sub, click.Group) and rest:  # fl data install ...
            subctx = sub.make_context(name, list(rest), resilient_parsing=True)
            name, sub, rest = sub.resolve_command(subctx, subctx.protected_args + subctx.args)
        params = sub.make_context(name, list(rest), resilient_parsing=False).params
    except click.exceptions.UsageError as e:
        raise AssertionError(f"{where}: `{command}`: {e.format_message()}") from None
    if PLACEHOLDER.search(command) or set(re.split(r"[\s=,:+]", command)) & set(made) or any(s.startswith("partition.from=") for s in params.get("sets") or ()):
        return  # names files or values the page makes first: parsed only
    if name == "run" and not params.get("config_file") and not params.get("resume_dir"):
        _checked(where, command, params.get("plugin") or "fedavg", list(params.get("sets") or ()))
    if name == "compare" and params.get("plugins"):
        sets = list(params.get("sets") or ())
        for entry in str(params["plugins"]).split(","):
            algo, *variant = entry.split("+")
            own = [s.split(":", 1)[1] for s in sets if re.match(rf"^{re.escape(algo)}:", s)]
            common = [s for s in sets if not re.match(r"^[a-z0-9_]+:", s)]
            _checked(where, command, algo, common + own + variant)


def _checked(where: str, command: str, plugin: str, sets: List[str]) -> None:
    from pflkit.core import PflError
    try:
        _resolve(plugin, sets)
    except PflError as e:
        raise AssertionError(f"{where}: `{command}` is refused: {e}") from None
