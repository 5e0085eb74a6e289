"""fl reproduce writes only inside --out (issue 36, HIGH 2): a table's ids -- table, row and column -- are plain
names, so a column id ``..`` (which overwrote the user's own results.md and results.csv), ``../../x``, an absolute
path or an id with a newline is refused by ``--check`` and by a run, through ``--table-file`` and through an
installed ``pflkit.tables`` entry; every file the command writes is resolved and must lie inside --out."""
from __future__ import annotations

import pytest

from pflkit.core.api import registry as reg
from pflkit.core.results.reproduce import inside_out
from pflkit.core import ConfigError

from test_reproduce import TINY_TABLE, one_line_error, run

BAD_IDS = ["..", "../../x", "/tmp/abs", "a\\nb", ".hidden", "x" * 65, "a b", "a/b"]


def _with_column_id(ident: str) -> str:
    return TINY_TABLE.replace('id = "mean"', f'id = "{ident}"', 1).replace("fedavg = { mean =", f'fedavg = {{ "{ident}" =', 1) \
        .replace("fedprox = { mean =", f'fedprox = {{ "{ident}" =', 1)


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    """The user's working folder, with their own results files that nothing may overwrite."""
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    for name in ("results.md", "results.csv"):
        (work / name).write_text("mine")
        (work.parent / name).write_text("mine")
    monkeypatch.chdir(work)
    return work


def _untouched(work):
    return all((folder / name).read_text() == "mine" for folder in (work, work.parent)
               for name in ("results.md", "results.csv"))


@pytest.mark.parametrize("ident", BAD_IDS)
def test_a_column_id_that_is_no_plain_name_is_refused_by_check_and_run(tmp_path, users_folder, ident):
    path = tmp_path / "evil.toml"
    path.write_text(_with_column_id(ident))
    line = one_line_error(run("--check", "--table-file", str(path)))
    assert "columns[0].id" in line and "is not a plain name" in line, line
    line = one_line_error(run("--table-file", str(path), "--scale", "quick", "--seeds", "0", "--out", "out"))
    assert "is not a plain name" in line
    assert _untouched(users_folder) and not (users_folder / "out").exists()


@pytest.mark.parametrize("where", ["row", "name"])
def test_row_ids_and_table_names_are_plain_names_too(tmp_path, where, registries_snapshot):
    if where == "row":
        text = TINY_TABLE.replace('id = "fedavg"', 'id = "../fedavg"', 1).replace("fedavg = {", '"../fedavg" = {', 1)
        path = tmp_path / "evil.toml"
        path.write_text(text)
        assert "rows[0].id: '../fedavg' is not a plain name" in one_line_error(
            run("--check", "--table-file", str(path)))
    else:
        reg.TABLES.register("tests:../evil", reg.parse_table_text(TINY_TABLE, "<test>"))
        result = run("tests:../evil", "--scale", "quick", "--out", str(tmp_path / "o"))
        assert result.exit_code == 2 and "is not a plain name" in result.output
        assert not (tmp_path / "o").exists()


def test_an_installed_table_with_an_escaping_column_id_writes_nothing_outside_out(tmp_path, users_folder,
                                                                                  registries_snapshot):
    reg.TABLES.register("tests:evil", reg.parse_table_text(_with_column_id(".."), "<test>"))
    line = one_line_error(run("tests:evil", "--scale", "quick", "--seeds", "0", "--out", "out"))
    assert "columns[0].id: '..' is not a plain name" in line
    assert _untouched(users_folder)
    check = run("--check")
    assert check.exit_code == 2 and "tests:evil" in check.output and "is not a plain name" in check.output


def test_every_written_path_is_resolved_inside_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert inside_out(out, out / "results.md") == out / "results.md"
    (out / "results.md").symlink_to(tmp_path / "elsewhere.md")  # a link planted in --out
    with pytest.raises(ConfigError, match="would be written outside it"):
        inside_out(out, out / "results.md")
    with pytest.raises(ConfigError, match="would be written outside it"):
        inside_out(out, out / ".." / "results.csv")


def test_ctrl_c_between_runs_exits_130_and_says_how_to_continue(tmp_path, monkeypatch):
    """Ctrl-C between two runs of fl reproduce exited 1 with click's 'Aborted!' (issue 36): 130, as fl compare."""
    import pflkit.core.results.reproduce as R
    from test_reproduce import TINY_TABLE as text

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(R, "run_comparison", interrupted)
    monkeypatch.setattr(R, "estimate_table", lambda *a, **k: "estimate skipped")
    path = tmp_path / "t.toml"
    path.write_text(text)
    result = run("--table-file", str(path), "--scale", "quick", "--seeds", "0", "--out", str(tmp_path / "o"))
    assert result.exit_code == 130 and "Aborted" not in result.output
    assert "interrupted; rerun the same command to continue" in result.output


def test_one_broken_installed_table_blocks_no_other(tmp_path, registries_snapshot):
    """A third-party table that does not parse names itself in --list and --check and leaves the others usable
    (it blocked every table before)."""
    reg.TABLES.register("tests:broken", reg.parse_table_text(TINY_TABLE.replace('caption =', 'captoin ='), "<t>"))
    reg.TABLES.register("tests:tiny", reg.parse_table_text(TINY_TABLE, "<test>"))
    listed = run("--list")
    assert listed.exit_code == 0 and "tests:tiny" in listed.output and "tests:broken: BROKEN" in listed.output
    checked = run("--check")
    assert checked.exit_code == 2 and "tests:tiny: ok" in checked.output and "pcfl:table3: ok" in checked.output
    assert "tests:broken: BROKEN" in checked.output and "unknown key 'captoin'" in checked.output
    ran = run("tests:tiny", "--scale", "quick", "--seeds", "0", "--rows", "fedavg", "--cols", "mean", "--out",
              str(tmp_path / "o"))
    assert ran.exit_code == 0, ran.output
    assert "unknown key 'captoin'" in one_line_error(run("tests:broken", "--out", str(tmp_path / "b")))


def test_an_entry_points_table_file_is_read_no_further_than_the_cap(tmp_path, monkeypatch):
    """The 1 MiB cap bounds what is read (the file was read whole first): a FIFO that never ends, or a huge file,
    is refused after the cap's bytes."""
    import sys

    try:
        import importlib_metadata as metadata
    except ImportError:  # pragma: no cover
        from importlib import metadata
    from pflkit.core import PluginError

    pkg = tmp_path / "hugetable"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "big.toml").write_bytes(b"#" * (reg.TABLE_FILE_LIMIT + 10))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hugetable", None)
    ep = metadata.EntryPoint(name="x:big", value="hugetable:big.toml", group="pflkit.tables")

    with pytest.raises(PluginError, match="is over 1048576 bytes"):
        reg.load_table_entry(ep)
