"""Run monitoring: TensorBoard event files plus a JSON-lines record of the same scalars; per-round progress on the
console and in ``run.log``. Every file here is opened without following a link (``safefiles``)."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..common.safefiles import check_tree, ensure_dir, open_append, open_read, write_atomic


def _round_of(line: str) -> Optional[int]:
    """The round of one metrics.jsonl line; None for a blank or half-written line (a killed write)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return int(rec.get("round", 0)) if isinstance(rec, dict) and isinstance(rec.get("round", 0), int) else None


class RunLogger:
    """Collects one round's scalars (core's and plugins'), writes them to TensorBoard and ``metrics.jsonl``.

    Plugins call ``log_scalar`` / ``log_histogram`` / ``log_image`` / ``log_text`` through their context;
    everything logged during round r is stamped with step r.
    """

    def __init__(self, run_dir: Path, resume_from_round: Optional[int] = None, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.step = 0
        self._pending: Dict[str, float] = {}
        if resume_from_round is not None:
            self._truncate_jsonl(resume_from_round)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                purge = None if resume_from_round is None else resume_from_round + 1
                tb = ensure_dir(self.run_dir / "tb")  # a real directory, not a link planted there
                check_tree(tb)
                self.writer = SummaryWriter(log_dir=str(tb), purge_step=purge)
            except ImportError:  # tensorboard is a dependency, but keep runs going without it
                self.writer = None

    def _truncate_jsonl(self, last_round: int) -> None:
        if not self.jsonl_path.exists() and not self.jsonl_path.is_symlink():
            return
        with open_read(self.jsonl_path) as f:  # never through a link; rewritten via a temporary file
            kept = [ln for ln in (raw.decode("utf-8", errors="replace").rstrip("\r\n") for raw in f)
                    if _round_of(ln) is not None and _round_of(ln) <= last_round]
        write_atomic(self.jsonl_path, "".join(ln + "\n" for ln in kept))

    def set_step(self, step: int) -> None:
        self.step = step

    def log_scalar(self, tag: str, value: float, step: Optional[int] = None) -> None:
        """Record ``value`` for this round; with an explicit ``step`` (a curve inside one round, e.g. set-up
        pre-training steps) it goes to TensorBoard at that step only, not into the round's record."""
        value = float(value)
        if step is None:
            self._pending[tag] = value
        if self.writer is not None and math.isfinite(value):
            self.writer.add_scalar(tag, value, self.step if step is None else step)

    def log_scalars(self, values: Dict[str, float], prefix: str = "") -> None:
        for k, v in values.items():
            self.log_scalar(prefix + k, v)

    def log_histogram(self, tag: str, values: Iterable[float]) -> None:
        arr = np.asarray(list(values), dtype=np.float64)
        if self.writer is not None and arr.size and np.isfinite(arr).all():
            self.writer.add_histogram(tag, arr, self.step)

    def log_image(self, tag: str, image: np.ndarray, step: Optional[int] = None) -> None:
        """``image``: HxW (values scaled to [0, 1] for display) or HxWx3 in [0, 1]."""
        if self.writer is None:
            return
        step = self.step if step is None else step
        img = np.asarray(image, dtype=np.float64)
        if img.ndim == 2:
            lo, hi = float(np.nanmin(img)), float(np.nanmax(img))
            img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
            self.writer.add_image(tag, img[None], step, dataformats="CHW")
        else:
            self.writer.add_image(tag, img, step, dataformats="HWC")

    def log_text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, self.step)

    def end_round(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        record = {"round": self.step, **self._pending, **(extra or {})}
        with open_append(self.jsonl_path) as f:
            f.write(json.dumps(record) + "\n")
        self._pending = {}
        if self.writer is not None:
            self.writer.flush()
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# Console progress and run.log ---------------------------------------------------------------------------------
RUN_LOG_NAME = "run.log"


def round_line(record: Dict[str, Any], total: int, metric: str, seconds: float) -> str:
    """One round as one line: round, training loss, the test metric (uniform and weighted) when evaluated, time."""
    pct = metric == "accuracy"
    fmt = (lambda v: f"{100 * v:.2f}%") if pct else (lambda v: f"{v:.5f}")
    parts = [f"round {record.get('round', '?')}/{total}"]
    if "train_loss" in record:
        parts.append(f"loss {record['train_loss']:.4f}")
    if f"{metric}/uniform" in record:
        parts.append(f"{metric} {fmt(record[f'{metric}/uniform'])} (weighted {fmt(record[f'{metric}/weighted'])})")
    if record.get("client_failures"):
        parts.append(f"{int(record['client_failures'])} client failure(s)")
    parts.append(f"{seconds:.1f} s")
    return "  ".join(parts)


# Time estimates ----------------------------------------------------------------------------------------------
ESTIMATE_MIN_SECONDS = 30.0  # an estimate is printed only when what is left takes longer: short runs stay quiet


def _clock() -> float:
    """The reporter's time source for set-up estimates (a module function, so tests can replace it)."""
    return time.monotonic()


def duration(seconds: float) -> str:
    """``45 s``, ``8 min 40 s``, ``2 h 31 min``: a duration as a person reads it."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {(s % 3600) // 60} min"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def evaluations_after(rnd: int, total: int, every: int) -> int:
    """How many of rounds rnd+1 .. total are evaluated (every ``every``-th round, and always the last)."""
    if rnd >= total:
        return 0
    every = max(1, int(every))
    return total // every - rnd // every + (1 if total % every else 0)


def setup_estimate_line(seconds: float, units: int, done: int, total: int) -> Optional[str]:
    """The set-up estimate after a measured block of ``units`` units (``done`` of ``total`` now), or None when what
    is left is shorter than ``ESTIMATE_MIN_SECONDS``."""
    left = seconds / units * (total - done)
    if left < ESTIMATE_MIN_SECONDS:
        return None
    return (f"set-up: about {duration(left)} left, estimated from {units} of its {total} steps in "
            f"{duration(seconds)}; the rounds' time is estimated after round 1")


def run_estimate_line(record: Dict[str, Any], seconds: float, total: int, eval_every: int,
                      now: Optional[datetime] = None, note: str = "", always: bool = False) -> Optional[str]:
    """The rest of the run estimated from one round (``seconds``, evaluation included when the round was evaluated:
    ``record['eval_seconds']``, plus ``global_eval_seconds`` of the global model): its training time for each
    remaining round plus its evaluation time for each remaining evaluation. None when fewer than
    ``ESTIMATE_MIN_SECONDS`` are left (unless ``always``); ``note`` ends the line (e.g. why it is rough)."""
    rnd = record.get("round")
    if not isinstance(rnd, int) or rnd >= total:
        return None
    eval_s = round_eval_seconds(record)
    train_s = seconds if eval_s is None else max(0.0, seconds - eval_s)
    return rate_estimate_line(rnd, total, eval_every, train_s, eval_s, now=now, note=note, always=always)


def round_eval_seconds(record: Dict[str, Any]) -> Optional[float]:
    """The evaluation seconds of one round's record (the global model's own evaluation added), None when the round
    was not evaluated."""
    eval_s = record.get("eval_seconds")
    global_s = record.get("global_eval_seconds")  # the global model's evaluation (core/engine/globaleval.py)
    if not isinstance(eval_s, (int, float)) or isinstance(eval_s, bool) or not math.isfinite(eval_s):
        return None
    if isinstance(global_s, (int, float)) and not isinstance(global_s, bool) and math.isfinite(global_s):
        eval_s = eval_s + global_s
    return float(eval_s)


def _left_seconds(rnd: int, total: int, eval_every: int, train_s: float, eval_s: Optional[float]) -> float:
    return train_s * (total - rnd) + (eval_s or 0.0) * evaluations_after(rnd, total, eval_every)


def rate_estimate_line(rnd: int, total: int, eval_every: int, train_s: float, eval_s: Optional[float],
                       now: Optional[datetime] = None, note: str = "", always: bool = False) -> Optional[str]:
    """The rest of the run after round ``rnd`` at ``train_s`` a round and ``eval_s`` an evaluation (None: not timed
    yet). None when nothing is left, or fewer than ``ESTIMATE_MIN_SECONDS`` unless ``always``."""
    if rnd >= total:
        return None
    rounds_left, evals_left = total - rnd, evaluations_after(rnd, total, eval_every)
    left = _left_seconds(rnd, total, eval_every, train_s, eval_s)
    if eval_s is not None:
        how = f"{train_s:.1f} s a round + {_count(evals_left, 'evaluation')} of {eval_s:.1f} s"
    else:  # no evaluation timed yet: the rounds' training alone
        how = f"{train_s:.1f} s a round + {_count(evals_left, 'evaluation')} not timed yet"
    if left < ESTIMATE_MIN_SECONDS and not always:
        return None
    end = (now or datetime.now()) + timedelta(seconds=left)
    line = f"estimate: {_count(rounds_left, 'more round')}, about {duration(left)} ({how}); done around {end:%H:%M}"
    return f"{line}; {note}" if note else line


ROUGH_NOTE = "rough: the first round of a start includes one-time warm-up, re-estimated after the next round"
REESTIMATE_DRIFT = 0.25  # a later estimate is printed when the time left moved by more than this share (and 30 s)


class RunEstimator:
    """When to state the run time left, from the rounds of one start fed with their measured seconds.

    The first round of a start carries one-time warm-up (first calls into torch and the trainer, data loading
    into caches), often several times a later round: its estimate is said to be rough. The second round gives
    the rate (printed also when short, as it corrects the rough one); later rounds re-estimate from the mean of
    rounds 2.. of the start and print when the time left moved by more than ``REESTIMATE_DRIFT`` of itself (and
    more than ``ESTIMATE_MIN_SECONDS``) from what the last line said.
    """

    def __init__(self, total: int, eval_every: int, now: Callable[[], datetime] = datetime.now):
        self.total, self.eval_every, self._now = total, eval_every, now
        self._rounds = 0                      # rounds of this start fed so far
        self._train: List[float] = []         # training seconds of rounds 2.. of this start
        self._evals: List[float] = []         # evaluation seconds of rounds 2.. of this start
        self._first_eval: Optional[float] = None
        self._said: Optional[float] = None    # the time left the last printed line said, less the time since

    def add(self, record: Dict[str, Any], seconds: float) -> Optional[str]:
        """Feed one finished round (its record and measured seconds); the estimate line to print, or None."""
        rnd = record.get("round")
        self._rounds += 1
        if self._said is not None:
            self._said = max(0.0, self._said - seconds)
        if not isinstance(rnd, int) or rnd >= self.total:
            return None
        eval_s = round_eval_seconds(record)
        train_s = seconds if eval_s is None else max(0.0, seconds - eval_s)
        if self._rounds == 1:
            self._first_eval = eval_s
            return self._say(rnd, train_s, eval_s, ROUGH_NOTE, always=False)
        self._train.append(train_s)
        if eval_s is not None:
            self._evals.append(eval_s)
        rate = sum(self._train) / len(self._train)
        ev = sum(self._evals) / len(self._evals) if self._evals else self._first_eval
        if self._rounds == 2:  # the first estimate without warm-up; it corrects a rough one even when short
            return self._say(rnd, rate, ev, "", always=self._said is not None)
        left = _left_seconds(rnd, self.total, self.eval_every, rate, ev)
        said = self._said if self._said is not None else 0.0
        if abs(left - said) <= max(ESTIMATE_MIN_SECONDS, REESTIMATE_DRIFT * max(left, said)):
            return None
        return self._say(rnd, rate, ev, f"re-estimated from rounds {rnd - self._rounds + 2}-{rnd}",
                         always=self._said is not None)

    def _say(self, rnd: int, train_s: float, eval_s: Optional[float], note: str, always: bool) -> Optional[str]:
        line = rate_estimate_line(rnd, self.total, self.eval_every, train_s, eval_s, now=self._now(), note=note,
                                  always=always)
        if line is not None:
            self._said = _left_seconds(rnd, self.total, self.eval_every, train_s, eval_s)
        return line


class _RunLogHandler(logging.Handler):
    def __init__(self, sink: "RoundReporter"):
        super().__init__(level=logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write_log(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # a log file problem must never stop the run
            self.handleError(record)


def append_run_log(run_dir: Path, text: str) -> None:
    """Add one time-stamped line to ``RUN_DIR/run.log`` (e.g. a warning issued before the run loop starts)."""
    with open_append(Path(run_dir) / RUN_LOG_NAME) as f:
        f.write(f"{datetime.now():%Y-%m-%d %H:%M:%S} {text}\n")


class RoundReporter:
    """Per-round progress for people and for batch jobs.

    - a tqdm bar on stderr when stderr is a terminal;
    - one line per round on stdout when stdout is not a terminal (a batch or cluster job's log) or when there is no
      bar (stderr redirected), flushed at once;
    - ``run.log`` in the run directory always: the same lines plus every warning logged during the run.

    While the bar is drawn, log records and Python warnings are written above it instead of through it.
    ``console=False`` (``--no-progress``) keeps the console quiet; run.log is still written.

    Time estimates, one line each and once per start, where the lines go: after the first measured block of a
    set-up that reports its progress (``SetupStep`` with ``done``/``total``), the set-up time left; after the first
    round of this start a rough estimate of the rest of the run, after the second one from its rate, later when it
    moved (``RunEstimator``, with ``eval_every`` the evaluation cadence). An estimate is printed only when it
    exceeds ``ESTIMATE_MIN_SECONDS`` (or corrects an earlier one). ``setup_echo`` also receives each set-up line
    (with ``console=False``: a comparison says which run is setting up and where it stands).
    """

    def __init__(self, run_dir: Path, total: int, initial: int, desc: str, metric: str, console: bool = True,
                 eval_every: int = 1, setup_echo: Optional[Callable[[str], None]] = None):
        self.run_dir = Path(run_dir)
        self.setup_echo = setup_echo  # also receives every set-up line (fl compare / reproduce without a console)
        self.total, self.initial, self.desc, self.metric = total, initial, desc, metric
        self.eval_every = eval_every
        self.console = console
        # set-up timing: (time, units done) where the measured block starts; None until set-up starts, and the
        # units None while unknown (a set-up resumed part-way: the first step only marks where it stands)
        self._setup_mark: Optional[Tuple[float, Optional[int]]] = None
        self._setup_estimated = False
        self._estimator = RunEstimator(total, eval_every)
        self.bar = None
        # lines whenever stdout is not a terminal, and also when no bar can be drawn (stderr redirected)
        self.lines = console and (not _isatty(sys.stdout) or not _isatty(sys.stderr))
        self._stack = contextlib.ExitStack()
        self._file = None
        self._bar_in_setup = False  # the bar counts set-up steps (setup_step) until setup_finished

    def __enter__(self) -> "RoundReporter":
        self._file = open_append(self.run_dir / RUN_LOG_NAME)
        self._stack.callback(self._file.close)
        handler = _RunLogHandler(self)
        root = logging.getLogger()
        if not root.handlers:  # used from Python without logging set up: keep warnings on the console too
            console = logging.StreamHandler(sys.stderr)
            console.setLevel(logging.WARNING)
            root.addHandler(console)
            self._stack.callback(root.removeHandler, console)
        root.addHandler(handler)
        self._stack.callback(root.removeHandler, handler)
        if getattr(logging, "_warnings_showwarning", None) is None:  # not captured already (by the caller)
            logging.captureWarnings(True)  # Python warnings go through logging: into run.log, above the bar
            self._stack.callback(logging.captureWarnings, False)
        if self.console and _isatty(sys.stderr):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc=self.desc, unit="round", dynamic_ncols=True)
            self._stack.callback(self.bar.close)
            self._stack.enter_context(logging_redirect_tqdm())
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._stack.close()
        return False

    def write_log(self, text: str) -> None:
        if self._file is not None and not self._file.closed:
            self._file.write(f"{datetime.now():%Y-%m-%d %H:%M:%S} {text}\n")
            self._file.flush()

    def note(self, text: str) -> None:
        """A line for run.log only (run start, resume, end)."""
        self.write_log(text)

    def setup_started(self, fresh: bool = True) -> None:
        """Set-up begins now: with ``fresh`` from nothing (the first step's block is measured from here), else
        resumed part-way (the first step only marks the start of the measured block)."""
        self._setup_mark = (_clock(), 0 if fresh else None)

    def setup_step(self, text: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
        """One resumable set-up step (round 0: e.g. a block of pre-training steps and its losses): a line in
        run.log and on the console; with ``done``/``total`` the bar counts set-up units until the rounds start,
        and the first measured block gives the estimate of the set-up time left."""
        if self.console and self.bar is not None and done is not None and total:
            if not self._bar_in_setup:  # the rounds' bar counts set-up until it ends
                self._bar_in_setup = True
                self.bar.unit = "step"
                self.bar.reset(total=total)
                self.bar.set_description(f"{self.desc} set-up")
            self.bar.n = done
            self.bar.refresh()
        self._setup_say(f"set-up: {text}")
        estimate = self._setup_estimate(done, total)
        if estimate is not None:
            self._setup_say(estimate)

    def _setup_say(self, line: str) -> None:
        self._say(line)
        if self.setup_echo is not None:
            self.setup_echo(line)

    def _setup_estimate(self, done: Optional[int], total: Optional[int]) -> Optional[str]:
        if self._setup_estimated or self._setup_mark is None or done is None or not total:
            return None
        start, start_done = self._setup_mark
        now = _clock()
        if start_done is None or done <= start_done:  # where a resumed set-up stands: measure from here
            self._setup_mark = (now, done)
            return None
        self._setup_estimated = True
        return setup_estimate_line(now - start, done - start_done, done, total)

    def _say(self, line: str) -> None:
        """A line for run.log and the console (above the bar when there is one)."""
        self.write_log(line)
        if not self.console:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout if self.lines else sys.stderr)
        else:
            print(line, file=sys.stdout, flush=True)

    def setup_finished(self) -> None:
        """Set-up is over: the bar counts rounds again."""
        if self.bar is not None and self._bar_in_setup:
            self._bar_in_setup = False
            self.bar.unit = "round"
            self.bar.reset(total=self.total)
            self.bar.update(self.initial)
            self.bar.set_description(self.desc)

    def round(self, record: Dict[str, Any], seconds: float, postfix: Dict[str, str]) -> None:
        line = round_line(record, self.total, self.metric, seconds)
        self.write_log(line)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix)
        if self.lines:
            if self.bar is not None:
                self.bar.write(line, file=sys.stdout)
            else:
                print(line, file=sys.stdout, flush=True)
        estimate = self._estimator.add(record, seconds)
        if estimate is not None:
            self._say(estimate)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
