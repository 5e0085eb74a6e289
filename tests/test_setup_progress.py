"""Set-up progress (round 0): what a ``setup_steps`` generator yields reaches run.log and the console, and the
progress bar counts set-up units until the rounds start (PCFL's flow training was a frozen 0/N bar)."""
from pflkit.core.storage import monitor
from pflkit.core.storage.monitor import RoundReporter


def test_setup_steps_move_the_bar_then_it_counts_rounds_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(monitor, "_isatty", lambda stream: True)  # a terminal: the bar is drawn
    with RoundReporter(tmp_path, total=200, initial=0, desc="pcfl", metric="mse") as rep:
        assert rep.bar is not None and rep.bar.total == 200
        rep.setup_step("flow steps 1-50 of 400: mean loss 0.5", 50, 401)
        assert (rep.bar.total, rep.bar.n) == (401, 50)
        rep.setup_step("flow steps 51-100 of 400: mean loss 0.25", 100, 401)
        assert rep.bar.n == 100
        rep.setup_finished()
        assert (rep.bar.total, rep.bar.n) == (200, 0)
    log = (tmp_path / "run.log").read_text()
    assert "set-up: flow steps 1-50 of 400: mean loss 0.5" in log and "set-up: flow steps 51-100" in log
    assert "set-up: flow steps 51-100 of 400: mean loss 0.25" in capsys.readouterr().err  # above the bar


def test_quiet_console_still_logs_setup(tmp_path, capsys):
    with RoundReporter(tmp_path, total=3, initial=0, desc="x", metric="accuracy", console=False) as rep:
        rep.setup_step("pre-training block 1")
        rep.setup_finished()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert "set-up: pre-training block 1" in (tmp_path / "run.log").read_text()
