"""Issue 29, results presentation: ``fl compare`` verifies a finished run before reusing it and prints one line per
run when its output is not a terminal; ``fl plot --group algorithm`` draws compare's figure; every accuracy axis is
in percent; untrusted numbers in run files are one line; ``fl list`` columns are aligned and no description is cut
in the middle of a sentence."""
import json
import re
import shutil

import pytest
from click.testing import CliRunner
from matplotlib.collections import PolyCollection
from matplotlib.ticker import PercentFormatter

from pflkit.core.api import registry as reg
from pflkit.core.results import runplot
from pflkit.core.cli.main import cli
from pflkit.core.results.compare import run_comparison
from pflkit.core.testing import TINY

TINY_SETS = ["--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=mlp",
             "--set", "model.hidden=[32]", "--set", "train.batch_size=32", "--set", "checkpoint.every=0"]


def fl(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_clear_line(res, fragment):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert fragment in res.output, res.output


def records(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_records(run_dir, recs):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished comparison (fedavg and local, seeds 0 and 1), copied fresh by ``comparison``."""
    out = tmp_path_factory.mktemp("done") / "cmp"
    results = run_comparison(["fedavg", "local"], [0, 1], [TINY], out)
    return out, results


@pytest.fixture
def comparison(finished, tmp_path):
    src, results = finished
    out = tmp_path / "cmp"
    shutil.copytree(src, out)
    return out, results


def _final(results, algo, seed):
    return next(r for r in results["results"][algo]["runs"] if r["seed"] == seed)["final_uniform"]


def _edit_summary(run_dir, **changes):
    doc = json.loads((run_dir / "summary.json").read_text())
    for key, value in changes.items():
        if "." in key:
            head, tail = key.split(".")
            doc[head][tail] = value
        else:
            doc[key] = value
    (run_dir / "summary.json").write_text(json.dumps(doc, indent=2))


# -- fl compare: a finished run is verified before it is reused ----------------------------------------------------
def test_an_untouched_finished_run_is_reused(comparison):
    out, first = comparison
    before = (out / "runs" / "fedavg-seed0" / "summary.json").stat().st_mtime_ns
    again = run_comparison(["fedavg", "local"], [0, 1], [TINY], out)
    assert (out / "runs" / "fedavg-seed0" / "summary.json").stat().st_mtime_ns == before
    assert not (out / "unverified").exists()
    assert again["results"]["fedavg"]["final_uniform"] == first["results"]["fedavg"]["final_uniform"]


@pytest.mark.parametrize("digest", ["with verified.json", "made before verified.json"])
def test_an_edited_summary_is_run_again_not_reused(comparison, digest):
    out, first = comparison
    run_dir = out / "runs" / "fedavg-seed0"
    if digest != "with verified.json":
        (run_dir / "verified.json").unlink(missing_ok=True)  # caught by re-deriving the numbers from metrics.jsonl alone
    _edit_summary(run_dir, **{"final.uniform": 0.99, "best.uniform": 0.99})
    lines = []
    again = run_comparison(["fedavg", "local"], [0, 1], [TINY], out, echo=lines.append)
    assert _final(again, "fedavg", 0) == _final(first, "fedavg", 0) != 0.99  # the rerun's number, not the edit
    assert json.loads((run_dir / "summary.json").read_text())["final"]["uniform"] == _final(first, "fedavg", 0)
    kept = out / "unverified" / "fedavg-seed0"
    assert json.loads((kept / "summary.json").read_text())["final"]["uniform"] == 0.99  # kept, never deleted
    assert any(ln.startswith("fedavg-seed0: not reused, summary.json gives final.uniform 0.99") for ln in lines), lines
    assert sum("not reused" in ln for ln in lines) == 1  # the three untouched runs are reused


def test_an_edited_metrics_value_is_caught_by_the_recorded_digest(comparison):
    out, first = comparison
    run_dir = out / "runs" / "local-seed1"
    recs = records(run_dir)
    recs[0]["round_seconds"] = 99.0  # no summary number comes from it: only the recorded digest sees the edit
    write_records(run_dir, recs)
    lines = []
    run_comparison(["fedavg", "local"], [0, 1], [TINY], out, echo=lines.append)
    assert any(ln.startswith("local-seed1: not reused") for ln in lines), lines
    assert records(run_dir)[0]["round_seconds"] != 99.0


@pytest.mark.parametrize("cut", ["last record gone", "half-written last line"])
def test_a_truncated_metrics_log_is_run_again(comparison, cut):
    out, first = comparison
    run_dir = out / "runs" / "local-seed0"
    (run_dir / "verified.json").unlink(missing_ok=True)  # as a run finished before digests were recorded
    text = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text(text[0] + "\n" + (text[1][:40] if cut != "last record gone" else ""))
    lines = []
    again = run_comparison(["fedavg", "local"], [0, 1], [TINY], out, echo=lines.append)
    assert any(ln.startswith("local-seed0: not reused, metrics.jsonl lacks round 2") for ln in lines), lines
    assert [r["round"] for r in records(run_dir)] == [1, 2]
    assert _final(again, "local", 0) == _final(first, "local", 0)


@pytest.mark.parametrize("rounds_done", [2, 1])
def test_a_run_whose_summary_says_failed_is_never_reused(comparison, rounds_done):
    """A failed run keeps its directory with a summary recording status 'failed' (issue 29, H3): never reused."""
    out, first = comparison
    run_dir = out / "runs" / "fedavg-seed1"
    (run_dir / "checkpoint.pt").unlink()  # a run that failed before its first checkpoint
    (run_dir / "verified.json").unlink(missing_ok=True)
    _edit_summary(run_dir, status="failed", reason="RunFailure: every selected client failed in round 2",
                  rounds_completed=rounds_done)
    lines = []
    again = run_comparison(["fedavg", "local"], [0, 1], [TINY], out, echo=lines.append)
    assert any(ln.startswith("fedavg-seed1: not reused") and "failed" in ln for ln in lines), lines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.get("status", "finished") == "finished" and summary["rounds_completed"] == 2
    assert _final(again, "fedavg", 1) == _final(first, "fedavg", 1)
    assert json.loads((out / "unverified" / "fedavg-seed1" / "summary.json").read_text())["status"] == "failed"


def test_compare_prints_one_line_per_run_when_stdout_is_not_a_terminal(tmp_path):
    res = fl("compare", "--plugins", "fedavg,local", "--seeds", "0,1", "--out", tmp_path / "c",
             *TINY_SETS, "--set", "rounds=3")  # progress bars on (the default), stdout a pipe
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert sum(bool(re.match(r"\[\d/4\] ", ln)) for ln in lines) == 4
    assert not [ln for ln in lines if ln.startswith("round ")], res.output  # 12 round lines before
    assert len(lines) < 30


# -- fl plot --group algorithm and percent axes ---------------------------------------------------------------------
@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures fl plot and fl compare save, kept for inspection."""
    saved = []
    real = runplot.save_figure

    def keep(fig, path, option="--out"):
        saved.append(fig)
        real(fig, path, option)

    monkeypatch.setattr(runplot, "save_figure", keep)
    return saved


def test_plot_group_algorithm_is_one_colour_and_one_band_per_algorithm(finished, tmp_path, figures):
    out, results = finished
    runs = sorted((out / "runs").iterdir())  # fedavg-seed0, fedavg-seed1, local-seed0, local-seed1
    ungrouped = fl("plot", *runs, "--out", tmp_path / "u.png")  # four colours for two algorithms: says so
    assert ungrouped.exit_code == 0 and "note: 4 runs of 2 algorithm(s); --group algorithm" in ungrouped.output
    res = fl("plot", *runs, "--group", "algorithm", "--out", tmp_path / "g.png")
    assert res.exit_code == 0, res.output
    assert "2 algorithm(s) from 4 run(s)" in res.output and (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    fig = figures[-1]
    for ax, key in zip(fig.axes[:2], ("uniform", "weighted")):
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert [ln.get_label() for ln in lines] == ["fedavg (n=2)", "local (n=2)"]
        assert lines[0].get_color() != lines[1].get_color()
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 2  # one band per algorithm, not one per run
        assert [tuple(b.get_facecolor()[0][:3]) for b in bands] == [
            tuple(matplotlib_rgb(ln.get_color())) for ln in lines]
        for line, algo in zip(lines, ("fedavg", "local")):  # the mean over the two seeds
            per_seed = [r["curve"][key] for r in results["results"][algo]["runs"]]
            assert list(line.get_ydata()) == pytest.approx([sum(v) / 2 for v in zip(*per_seed)])
        assert isinstance(ax.yaxis.get_major_formatter(), PercentFormatter)
    # compare's curves.png is the same figure, from the same code
    run_comparison(["fedavg", "local"], [0, 1], [TINY], out)
    compare_fig = figures[-1]
    assert [ln.get_label() for ln in compare_fig.axes[0].get_lines()] == ["fedavg (n=2)", "local (n=2)"]
    for a, b in zip(fig.axes[0].get_lines(), compare_fig.axes[0].get_lines()):
        assert list(a.get_ydata()) == list(b.get_ydata()) and a.get_color() == b.get_color()


def matplotlib_rgb(color):
    from matplotlib.colors import to_rgb

    return to_rgb(color)


def test_every_accuracy_axis_is_in_percent(finished, tmp_path, figures):
    out, _ = finished
    res = fl("plot", out / "runs" / "fedavg-seed0", out / "runs" / "local-seed0", "--out", tmp_path / "p.png")
    assert res.exit_code == 0, res.output
    ax_metric, ax_loss = figures[-1].axes[:2]
    assert isinstance(ax_metric.yaxis.get_major_formatter(), PercentFormatter)
    assert ax_metric.get_ylabel() == "accuracy (%)"
    assert not isinstance(ax_loss.yaxis.get_major_formatter(), PercentFormatter)  # a loss is not a percentage
    figures[-1].canvas.draw()
    labels = [t.get_text() for t in ax_metric.get_yticklabels() if t.get_text()]
    assert labels and all(t.endswith("%") for t in labels), labels


HUGE = [
    ("percentiles 1e308", lambda r: r[1].update({"accuracy/p90": 1e308, "accuracy/p10": -1e308}),
     "'accuracy/p10' = -1e+308", "run"),
    ("accuracy 1e308", lambda r: r[0].update({"accuracy/uniform": 1e308}),
     "round 1 has 'accuracy/uniform' = 1e+308", "run"),
    ("accuracy 1e308, grouped", lambda r: r[0].update({"accuracy/uniform": 1e308}),
     "round 1 has 'accuracy/uniform' = 1e+308", "algorithm"),
    ("round 10**400", lambda r: r[1].update({"round": 10 ** 400}), "line 2 is not a round record", "run"),
    ("round 10**400, grouped", lambda r: r[1].update({"round": 10 ** 400}), "line 2 is not a round record",
     "algorithm"),
    ("loss 1e300", lambda r: r[1].update({"train_loss": 1e300}), "round 2 has 'train_loss' = 1e+300", "run"),
    ("accuracy 10**200", lambda r: r[1].update({"accuracy/weighted": 10 ** 200}),
     "round 2 has 'accuracy/weighted' = 1e+200", "algorithm"),
]


@pytest.mark.parametrize("damage, fragment, group", [case[1:] for case in HUGE], ids=[case[0] for case in HUGE])
def test_huge_numbers_in_a_run_file_are_one_line(finished, tmp_path, damage, fragment, group):
    out, _ = finished
    run_dir = tmp_path / "run"
    shutil.copytree(out / "runs" / "fedavg-seed0", run_dir)
    recs = records(run_dir)
    damage(recs)
    write_records(run_dir, recs)
    one_clear_line(fl("plot", run_dir, "--group", group, "--out", tmp_path / "x.png"), fragment)
    assert not (tmp_path / "x.png").exists()


# -- fl list ---------------------------------------------------------------------------------------------------------
def test_fl_list_columns_are_aligned():
    res = fl("list")
    assert res.exit_code == 0, res.output
    # installed plugins only: names other tests registered in-process (hostile ones with spaces included) are theirs
    listing = res.output.split("plugins that failed to load")[0]  # load failures other tests leave are reported after
    rows = [ln for ln in listing.splitlines() if ln.startswith("  ") and "CONFLICT" not in ln
            and "<in-process>" not in ln]
    assert len(rows) > 50
    # name, distribution, version and the description's first word: each starts in one column on every line
    starts = {tuple(m.start() for m in re.finditer(r"\S+", ln))[:4]: ln for ln in rows}
    assert len(starts) == 1, list(starts.items())[:5]
    assert max(len(ln) for ln in res.output.splitlines()) <= 100


def test_an_over_long_cell_is_cut_with_a_mark():
    from pflkit.core.cli.listing import cell

    assert cell("fedavg", 10) == "fedavg    "
    cut = cell("x" * 300, 28)
    assert len(cut) == 28 and cut.endswith("...")


def test_no_description_is_cut_in_the_middle_of_a_sentence():
    checked = 0
    for registry in reg.ALL_REGISTRIES.values():
        registry.load_all()
        for entry in registry.entries():
            doc = getattr(entry.obj, "description", None) or getattr(entry.obj, "__doc__", None) or ""
            first = []
            for line in doc.strip().splitlines():
                if not line.strip():
                    break
                first.append(line.strip())
            text = reg.describe(entry.obj)
            assert text.startswith(" ".join(first)), (entry.name, text)  # the whole first paragraph, not a line
            assert not text.endswith((":", ",", ";")), (entry.name, text)
            checked += 1
    assert checked > 80
    lenet = reg.describe(reg.MODELS.get("lenet"))
    assert lenet.startswith("FedC2I's LeNet (Table 7)") and lenet.endswith("classifier."), lenet
