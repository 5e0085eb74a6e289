"""Time estimates of a run (core/storage/monitor.py): after the first measured block of a set-up that reports its progress,
one line with the set-up time left; after the first round, a rough line with the rest of the run (round 1 carries
warm-up), after the second one from its rate, later when the rate moved; none for a short wait. And what the first Ctrl-C says it waits for: the set-up step during set-up, the round afterwards.

Timing is made deterministic with fake clocks (``monitor._clock`` for set-up, ``rounds.time`` for rounds)."""
import itertools
import os
import signal
import types
from datetime import datetime

import pytest

from pflkit.core import Algorithm, Message, Param, SetupStep, Simulation
from pflkit.core.storage import monitor
from pflkit.core.engine import rounds
from pflkit.core.storage.monitor import RoundReporter, RunEstimator, evaluations_after, run_estimate_line
from pflkit.core.testing import tiny_config
from pflkit_fedavg import FedAvgAggregator, FedAvgTrainer


def fake_clock(monkeypatch, step: float):
    """``monitor._clock`` advancing ``step`` seconds at every call, from 0."""
    ticks = itertools.count()
    monkeypatch.setattr(monitor, "_clock", lambda: next(ticks) * step)


@pytest.fixture
def lines_mode(monkeypatch):
    monkeypatch.setattr(monitor, "_isatty", lambda stream: False)  # a batch job: lines on stdout


# -- set-up ----------------------------------------------------------------------------------------------------
def test_one_setup_estimate_after_the_first_block(tmp_path, monkeypatch, capsys, lines_mode):
    fake_clock(monkeypatch, 60.0)  # started at 0, each block 60 s later
    with RoundReporter(tmp_path, total=5, initial=0, desc="x", metric="mse") as rep:
        rep.setup_started()
        for done in (50, 100, 150, 200):
            rep.setup_step(f"block up to {done}", done, 201)
        rep.setup_finished()
    out = capsys.readouterr().out.splitlines()
    estimates = [ln for ln in out if "left, estimated" in ln]
    # 60 s for 50 of 201 steps: 151 steps left = 181 s
    assert estimates == ["set-up: about 3 min 1 s left, estimated from 50 of its 201 steps in 1 min; the rounds' "
                         "time is estimated after round 1"]
    assert out.index(estimates[0]) == out.index("set-up: block up to 50") + 1  # right after the first block
    log = (tmp_path / "run.log").read_text()
    assert log.count("left, estimated") == 1 and "about 3 min 1 s left" in log


def test_resumed_setup_measures_from_its_first_step(tmp_path, monkeypatch, capsys, lines_mode):
    fake_clock(monkeypatch, 10.0)
    with RoundReporter(tmp_path, total=5, initial=0, desc="x", metric="mse") as rep:
        rep.setup_started(fresh=False)          # t = 0; steps 1-300 were done by an earlier start
        rep.setup_step("up to 350", 350, 401)   # t = 10: where it stands, not a measured block
        assert "left" not in capsys.readouterr().out
        rep.setup_step("up to 400", 400, 401)   # t = 20: 50 steps in 10 s, 1 left
        rep.setup_step("regions", 401, 401)
    assert "left" not in capsys.readouterr().out  # 0.2 s left: below the threshold, and never a second try


def test_short_or_unmeasured_setup_prints_no_estimate(tmp_path, monkeypatch, capsys, lines_mode):
    fake_clock(monkeypatch, 1.0)
    with RoundReporter(tmp_path, total=5, initial=0, desc="x", metric="mse") as rep:
        rep.setup_started()
        rep.setup_step("block 1", 1, 20)        # 19 s left: under ESTIMATE_MIN_SECONDS
        rep.setup_step("plain line")            # no done/total
    (tmp_path / "b").mkdir()
    with RoundReporter(tmp_path / "b", total=5, initial=0, desc="x", metric="mse") as rep:
        rep.setup_started()
        rep.setup_step("plain line")            # a step without progress cannot be measured
        rep.setup_step("another")
    assert "left" not in capsys.readouterr().out


# -- rounds ----------------------------------------------------------------------------------------------------
def test_evaluations_after():
    assert evaluations_after(0, 10, 1) == 10
    assert evaluations_after(1, 10, 5) == 2        # rounds 5 and 10
    assert evaluations_after(1, 12, 5) == 3        # 5, 10 and the last, 12
    assert evaluations_after(5, 12, 5) == 2
    assert evaluations_after(12, 12, 5) == 0


def test_run_estimate_from_round_one():
    rec = {"round": 1, "train_loss": 0.5, "eval_seconds": 2.0}
    line = run_estimate_line(rec, 45.0, total=200, eval_every=5, now=datetime(2026, 1, 1, 12, 0))
    # 43 s of training x 199 rounds + 2 s x 40 evaluations = 8,637 s
    assert line == ("estimate: 199 more rounds, about 2 h 23 min (43.0 s a round + 40 evaluations of 2.0 s); "
                    "done around 14:23")
    line = run_estimate_line({"round": 1}, 10.0, total=100, eval_every=5, now=datetime(2026, 1, 1, 12, 0))
    assert "about 16 min 30 s" in line and "20 evaluations not timed yet" in line
    assert run_estimate_line({"round": 1, "eval_seconds": 0.1}, 1.0, total=20, eval_every=1) is None  # 19 s
    assert run_estimate_line({"round": 3}, 100.0, total=3, eval_every=1) is None  # nothing left


def test_run_estimate_rough_after_round_one_then_from_round_two(tmp_path, capsys, lines_mode):
    with RoundReporter(tmp_path, total=200, initial=0, desc="x", metric="accuracy", eval_every=5) as rep:
        for r in (1, 2, 3):
            rep.round({"round": r, "train_loss": 0.5, "eval_seconds": 1.0}, 20.0, {})
    out = capsys.readouterr().out.splitlines()
    # 19 s of training x 199 rounds + 1 s x 40 evaluations = 3,821 s; then 198 rounds + 40 evaluations = 3,802 s
    estimates = [ln for ln in out if ln.startswith("estimate:")]
    assert [ln.split(";")[0] for ln in estimates] == \
        ["estimate: 199 more rounds, about 1 h 3 min (19.0 s a round + 40 evaluations of 1.0 s)",
         "estimate: 198 more rounds, about 1 h 3 min (19.0 s a round + 40 evaluations of 1.0 s)"]
    assert "rough: the first round of a start includes one-time warm-up" in estimates[0]
    assert "rough" not in estimates[1]
    assert out[1].startswith("estimate:") and out[0].startswith("round 1/200")
    assert out[3].startswith("estimate:") and out[2].startswith("round 2/200")
    assert (tmp_path / "run.log").read_text().count("estimate:") == 2  # round 3 at the same rate: nothing new


FIXED_NOW = lambda: datetime(2026, 1, 1, 12, 0)  # noqa: E731


def _feed(estimator: RunEstimator, times):
    return [estimator.add({"round": r}, t) for r, t in enumerate(times, start=1)]


def test_warm_up_of_round_one_is_not_the_rate():
    """The quick start's case (issue 36): round 1 took 7 s with its warm-up, the others 1.3 s. Round 1 alone said
    "about 2 min" for 25 s of rounds; the estimate after round 2 says what is left and corrects it."""
    lines = _feed(RunEstimator(total=20, eval_every=100, now=FIXED_NOW), [7.0] + [1.3] * 19)
    assert lines[0].startswith("estimate: 19 more rounds, about 2 min 13 s") and "rough" in lines[0]
    assert lines[1].startswith("estimate: 18 more rounds, about 23 s (1.3 s a round")  # shorter than 30 s: said
    assert "rough" not in lines[1]
    assert lines[2:] == [None] * 18  # a steady rate is not said again


def test_short_run_with_a_fast_first_round_stays_quiet():
    assert _feed(RunEstimator(total=20, eval_every=5, now=FIXED_NOW), [1.0] * 20) == [None] * 20


def test_re_estimated_when_the_rate_moves():
    est = RunEstimator(total=100, eval_every=100, now=FIXED_NOW)
    lines = _feed(est, [30.0, 10.0, 10.0, 10.0])
    assert "rough" in lines[0] and lines[1].startswith("estimate: 98 more rounds, about 16 min 20 s")
    assert lines[2:] == [None, None]
    # the machine gets busy: rounds take 40 s; the mean of rounds 2.. grows and each move by 25 % is said
    more = [est.add({"round": r}, 40.0) for r in range(5, 8)]
    assert more[0].startswith("estimate: 95 more rounds, about 27 min 42 s (17.5 s a round")
    assert more[0].endswith("re-estimated from rounds 2-5")
    assert more[1] is None  # 22 s a round: within 25 % of what was said
    assert more[2].startswith("estimate: 93 more rounds, about 38 min 45 s (25.0 s a round")


def test_resumed_start_treats_its_first_round_as_warm_up():
    est = RunEstimator(total=60, eval_every=100, now=FIXED_NOW)
    lines = [est.add({"round": 41}, 20.0), est.add({"round": 42}, 2.0)]
    assert "19 more rounds" in lines[0] and "rough" in lines[0]
    assert lines[1].startswith("estimate: 18 more rounds, about 36 s (2.0 s a round")


def test_quiet_console_keeps_the_estimates_in_run_log(tmp_path, monkeypatch, capsys):
    fake_clock(monkeypatch, 60.0)
    with RoundReporter(tmp_path, total=50, initial=0, desc="x", metric="mse", console=False) as rep:
        rep.setup_started()
        rep.setup_step("block", 1, 10)
        rep.round({"round": 1}, 30.0, {})
    assert capsys.readouterr().out == ""
    log = (tmp_path / "run.log").read_text()
    assert "set-up: about 9 min left" in log and "estimate: 49 more rounds, about 24 min 30 s" in log


# -- through a run: a set-up in SetupSteps, Ctrl-C in set-up and in a round ----------------------------------------
class ProbeTrainer(FedAvgTrainer):
    def on_probe(self, payload):
        return {"ok": 1.0}


class BlockAggregator(FedAvgAggregator):
    """A set-up of ``blocks`` resumable blocks that reports its progress; ``interrupt_at``: Ctrl-C in that block."""

    params = {"blocks": Param(4, "set-up blocks"), "interrupt_at": Param(0, "block that sends SIGINT (0: none)")}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.done = 0

    def setup_steps(self, comm):
        while self.done < self.ctx.hp.blocks:
            comm.send({c: Message("probe") for c in comm.client_ids})
            self.done += 1
            if self.done == self.ctx.hp.interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, typed during this block
            yield SetupStep(f"block {self.done}", self.done, self.ctx.hp.blocks)

    def state_dict(self):
        return {"base": super().state_dict(), "done": self.done}

    def load_state_dict(self, state):
        super().load_state_dict(state["base"])
        self.done = int(state["done"])


@pytest.fixture
def blocks(registries_snapshot):
    reg = registries_snapshot
    reg.TRAINERS.register("probe-est", ProbeTrainer)
    reg.AGGREGATORS.register("blocks-est", BlockAggregator)
    reg.ALGORITHMS.register("blocks-est", Algorithm(trainer="probe-est", aggregator="blocks-est"))
    return reg


def _fake_round_time(monkeypatch, step: float):
    ticks = itertools.count()
    monkeypatch.setattr(rounds, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * step))


def test_a_run_prints_both_estimates(blocks, tmp_path, monkeypatch, capsys, lines_mode):
    fake_clock(monkeypatch, 40.0)           # each set-up block 40 s: 3 blocks = 120 s left after the first
    _fake_round_time(monkeypatch, 30.0)     # every perf_counter call 30 s later
    cfg = tiny_config("blocks-est", sets=("rounds=3", "aggregator.blocks=4"))
    Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False, progress=True).run()
    out = capsys.readouterr().out.splitlines()
    setup_est = [i for i, ln in enumerate(out) if "left, estimated" in ln]
    run_est = [i for i, ln in enumerate(out) if ln.startswith("estimate:")]
    assert len(setup_est) == 1 and out[setup_est[0] - 1] == "set-up: block 1"
    assert "about 2 min left, estimated from 1 of its 4 steps in 40 s" in out[setup_est[0]]
    assert len(run_est) == 2 and out[run_est[0] - 1].startswith("round 1/3")
    assert "2 more rounds" in out[run_est[0]] and "rough" in out[run_est[0]]
    assert out[run_est[1] - 1].startswith("round 2/3") and "1 more round," in out[run_est[1]]
    log = (tmp_path / "r" / "run.log").read_text()
    assert log.count("left, estimated") == 1 and log.count("estimate:") == 2  # rough after round 1, then from 2


def test_ctrl_c_during_setup_speaks_of_setup(blocks, tmp_path, caplog):
    cfg = tiny_config("blocks-est", sets=("rounds=2", "aggregator.blocks=4", "aggregator.interrupt_at=2"))
    out = Simulation(cfg, run_dir=tmp_path / "s", tensorboard=False).run()
    assert out["interrupted"] and out["rounds_completed"] == 0
    log = (tmp_path / "s" / "run.log").read_text()
    assert "interrupt: finishing this set-up step, writing a checkpoint, then stopping" in log
    assert "round" not in log.split("interrupt:")[1].splitlines()[0]
    sim = Simulation.resume(tmp_path / "s", tensorboard=False)
    assert sim.server.done == 2 and not sim.setup_done


def test_ctrl_c_in_a_round_speaks_of_the_round(blocks, tmp_path):
    cfg = tiny_config("blocks-est", sets=("rounds=3", "aggregator.blocks=1"))
    out = Simulation(cfg, run_dir=tmp_path / "r", tensorboard=False).run(
        on_round=lambda rec: os.kill(os.getpid(), signal.SIGINT) if rec["round"] == 1 else None)
    assert out["interrupted"] and out["rounds_completed"] == 1
    assert "interrupt: finishing this round, writing a checkpoint" in (tmp_path / "r" / "run.log").read_text()


class OnceAggregator(FedAvgAggregator):
    """A set-up in one piece (``setup``, not resumable) during which Ctrl-C is typed."""

    def setup(self, comm):
        comm.send({c: Message("probe") for c in comm.client_ids})
        os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_during_a_set_up_in_one_piece_says_it_cannot_pause(registries_snapshot, tmp_path):
    reg = registries_snapshot
    reg.TRAINERS.register("probe-once", ProbeTrainer)
    reg.AGGREGATORS.register("once-est", OnceAggregator)
    reg.ALGORITHMS.register("once-est", Algorithm(trainer="probe-once", aggregator="once-est"))
    out = Simulation(tiny_config("once-est", sets=("rounds=3",)), run_dir=tmp_path / "o", tensorboard=False).run()
    assert out["interrupted"] and out["rounds_completed"] == 1  # as the message says: set-up, round 1, stop
    assert "interrupt: this set-up cannot pause part-way: finishing it and round 1" in \
        (tmp_path / "o" / "run.log").read_text()


# -- fl reproduce / compare: a measured run's set-up is shown as it goes and counted (issue 36) ----------------------
def test_measuring_a_run_shows_its_set_up_and_the_estimate_counts_it(blocks, tmp_path, monkeypatch):
    """`fl reproduce` was silent for minutes while PCFL's flow trained in the measured run, then said "about 1 s"
    (the rest after the measurement). Now each set-up step of the measured run is a line naming the cell's folder
    and run, with the set-up estimate; the estimate line says what measuring took (set-up included) and counts
    each run not started yet with its set-up. A slow set-up is faked: no wall time."""
    from pflkit.core.engine.config import deep_merge
    from pflkit.core.results import estimate
    from pflkit.core.testing import TINY

    fake_clock(monkeypatch, 40.0)  # each set-up block 40 s
    _fake_round_time(monkeypatch, 2.0)  # a round 2 s
    ticks = itertools.count()  # the measurement's wall clock: 200 s from its start to its pause
    monkeypatch.setattr(estimate, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 200.0))
    folder = tmp_path / "col"
    layer = deep_merge(dict(TINY), {"rounds": 4, "aggregator": {"blocks": 4}, "checkpoint": {"every": 0}})
    said = []
    est = estimate.estimate_comparisons([(folder, layer)], ["blocks-est"], [0, 1], jobs=1, echo=said.append)
    setup = [ln for ln in said if ln.startswith("measuring col/blocks-est-seed0: set-up: ")]
    assert setup[:2] == ["measuring col/blocks-est-seed0: set-up: block 1",
                         "measuring col/blocks-est-seed0: set-up: about 2 min left, estimated from 1 of its 4 steps "
                         "in 40 s; the rounds' time is estimated after round 1"]
    assert setup[-1] == "measuring col/blocks-est-seed0: set-up: block 4"
    assert est.measured == 1 and est.measuring == pytest.approx(200.0)
    timing = estimate._read_timings(folder)["blocks-est-seed0"]
    assert timing.fixed > 150.0  # the set-up is the run's fixed cost...
    assert est.seconds >= timing.fixed and est.fixed == pytest.approx(timing.fixed)  # ...counted for seed 1
    line = estimate.estimate_line(est, "t", 1)
    assert "measuring took 3 min 20 s, set-up included" in line
    assert f"each run not started yet counts its set-up and first-round warm-up (up to {monitor.duration(timing.fixed)})" \
        in line


def test_a_comparison_run_shows_its_set_up_lines(blocks, tmp_path):
    from pflkit.core.engine.config import deep_merge
    from pflkit.core.results.compare import run_comparison
    from pflkit.core.testing import TINY

    layer = deep_merge(dict(TINY), {"rounds": 1, "aggregator": {"blocks": 2}})
    said = []
    run_comparison(["blocks-est"], [0], [layer], tmp_path / "out", echo=said.append)
    assert said[:2] == ["blocks-est seed 0: set-up: block 1", "blocks-est seed 0: set-up: block 2"]
    assert said[2].startswith("[1/1] blocks-est seed 0: finished 1/1 rounds")
