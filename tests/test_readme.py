"""The README's quick-start summary block is what the quick-start command prints.

The command is read from the README's ``ci:install`` block (the part after ``&&``: ``fl run --plugin fedavg``) and
run as a new user would, in an empty directory; every line of the README's summary block that carries a result
(algorithm, dataset and clients, rounds, every accuracy with its round, min/max client, communication, failures)
must equal the printed line, and every printed result line must be in the block. Paths, timings and the
checkpoint size are not compared (the block elides them with ``...``). Editing a number in the README, or a
change of the code that moves a number, fails this test; the fix is to paste the new output into the README.

One run of the quick start: about 17 s of CPU time (30 rounds, 20 clients, the 8x8 digits).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
KEY_VALUE = re.compile(r"^(\S.*?)\s{2,}(\S.*)$")
NOT_COMPARED = ("checkpoint", "metrics:", "watch in TensorBoard")  # paths and sizes, not results


def fenced_blocks(text: str):
    """(line index of the opening fence, lines inside) of every fenced block."""
    lines, blocks, start = text.splitlines(), [], None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start = i
            else:
                blocks.append((start, lines[start + 1:i]))
                start = None
    return lines, blocks


def quickstart_command_and_block():
    lines, blocks = fenced_blocks(README.read_text(encoding="utf-8"))
    marker = next(i for i, line in enumerate(lines) if "<!-- ci:install -->" in line)
    install = next(body for start, body in blocks if start > marker)[0]
    assert "&&" in install, f"the ci:install block no longer ends with the quick-start run: {install!r}"
    command = shlex.split(install.split("&&", 1)[1])
    summary = next(body for start, body in blocks if body and body[0].startswith("algorithm "))
    return command, summary


def result_lines(lines):
    """key -> value of the summary lines that carry results."""
    out = {}
    for line in lines:
        m = KEY_VALUE.match(line.rstrip())
        if m and not m.group(1).startswith(NOT_COMPARED):
            out[m.group(1)] = m.group(2)
    return out


def result_keys(lines):
    """The result lines' keys in order, repeats included (result_lines would hide a duplicated line)."""
    return [m.group(1) for m in map(KEY_VALUE.match, (line.rstrip() for line in lines))
            if m and not m.group(1).startswith(NOT_COMPARED)]


def test_readme_block_is_parsed():
    command, block = quickstart_command_and_block()
    assert command[:2] == ["fl", "run"]
    expected = result_lines(block)
    # the block shows at least these results; if the parser lost them the comparison below would be vacuous
    for key in ("algorithm", "dataset / clients", "rounds completed", "client failures",
                "communication up / down"):
        assert key in expected, f"README summary block lacks '{key}'"
    assert any(k.startswith("final accuracy, uniform") for k in expected)
    assert any(k.startswith("best accuracy, uniform") for k in expected)


def test_readme_quickstart_summary_matches_a_fresh_run(tmp_path):
    command, block = quickstart_command_and_block()
    expected = result_lines(block)
    # `fl` as the module, so the test runs the checkout's code; one torch thread, as the README's block states
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pflkit.core.cli", *command[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    start = out.index("\nalgorithm ") + 1  # the summary table, after the per-round lines
    printed = result_lines(out[start:].splitlines())
    assert printed, out[-2000:]
    mismatched = {k: (v, printed.get(k, "<not printed>")) for k, v in expected.items() if printed.get(k) != v}
    assert not mismatched, ("README quick-start block (left) differs from what "
                            f"`{' '.join(command)}` printed (right): {mismatched}")
    missing = sorted(set(printed) - set(expected))
    assert not missing, f"printed result lines missing from the README block: {missing}"
    assert [k for k in result_keys(block)] == [k for k in result_keys(out[start:].splitlines())], \
        "the README block's result lines are not the printed ones, in the printed order (a repeated line?)"
