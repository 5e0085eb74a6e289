"""A published results CSV holds only when it comes from one clean commit (issue 36): ``fl results --check`` (which
the test suite runs over the repository) refuses one whose runs name a tree with uncommitted changes, more than one
commit, or runs that recorded none beside ones that did -- unless its notes say "not re-measured"."""
from __future__ import annotations

from pflkit.core.results.published import PROVENANCE, provenance_problem, results_csv


def _csv(tmp_path, commit: str, notes: str = "") -> object:
    prov = {p: "" for p in PROVENANCE}
    prov.update({"commit": commit, "notes": notes})
    path = tmp_path / "r.csv"
    path.write_text(results_csv(["row", "mean"], [{"row": "fedavg", "mean": "50.00"}], prov))
    return path


def test_one_clean_commit_passes(tmp_path):
    assert provenance_problem(_csv(tmp_path, "ec137db7a0")) is None


def test_uncommitted_changes_fail(tmp_path):
    why = provenance_problem(_csv(tmp_path, "ec137db7a0 (uncommitted changes)"))
    assert "runs from trees with uncommitted changes" in why and "one clean commit" in why


def test_two_commits_fail(tmp_path):
    assert "runs from 2 commits (655422bdf9, 7581f276ec)" in provenance_problem(_csv(tmp_path, "7581f276ec; 655422bdf9"))


def test_a_commit_beside_unrecorded_runs_fails(tmp_path):
    why = provenance_problem(_csv(tmp_path, "be416f04ad; not recorded for 27 of 45 run starts"))
    assert "recorded no commit beside ones that did" in why


def test_not_remeasured_is_a_record_kept_as_it_was(tmp_path):
    assert provenance_problem(_csv(tmp_path, "7581f276ec (uncommitted changes); 655422bdf9",
                                   "not re-measured (several commits)")) is None


def test_fl_results_never_writes_through_a_link_outside_root(tmp_path):
    """A document that is a symlink to a file outside --root is refused, the outside file untouched (issue 36)."""
    from click.testing import CliRunner

    from pflkit.core.testing import cli

    root = tmp_path / "repo"
    (root / "results").mkdir(parents=True)
    _csv(root / "results", "ec137db7a0").rename(root / "results" / "t.csv")
    outside = tmp_path / "outside.md"
    outside.write_text("<!-- results: results/t.csv -->\n| stale |\n<!-- /results -->\n")
    (root / "README.md").symlink_to(outside)
    res = CliRunner().invoke(cli, ["results", "--root", str(root)])
    assert res.exit_code == 2 and "outside --root" in res.output
    assert outside.read_text().startswith("<!-- results: results/t.csv -->\n| stale |")
