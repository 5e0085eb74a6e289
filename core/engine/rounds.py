"""The round loop of a run, top to bottom as the docs' "Round protocol" (docs/concepts.md): the set-up phase
(round 0), then per round select the clients, run the server's round, evaluate every client, log the round, and checkpoint at the
configured cadence; Ctrl-C (or ``stop_after``) pauses after a round with a checkpoint.

``RoundLoop`` is the part of ``Simulation`` that drives the rounds; ``Simulation`` (core/engine/simulation.py) builds
the parts it drives and keeps their checkpoint state, ``core/storage/rundir.py`` holds the run directory.
"""
from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from easydict import EasyDict

from ..api import adaptation
from ..storage import runinfo
from .backend import ExecutionBackend
from .comm import Communicator
from .silent import SilentReporter
from ..storage.checkpoint import checkpoint_exists
from ..api.clientstate import SPILL_DIR
from ..common.errors import ConfigError, PflError
from .evaluation import History, per_client_metric, per_client_record, per_client_validation, summarize
from .globaleval import GlobalEvaluation
from ..storage.monitor import RoundReporter, RunLogger, append_run_log
from ..storage.reporting import strict_json
from ..storage.rundir import RunDirectory, remove_empty_folders
from ..common.safefiles import write_atomic
from ..api.serverstore import SERVER_SPILL_DIR, ServerStores
from ..common.seeding import derive_seed, seed_everything
from ..api.server import ServerAggregator, ServerContext, SetupStep
from ..api.task import Task
from ..common.threads import effective_threads, torch_threads

log = logging.getLogger("pflkit")


class RunFailure(PflError):
    """The run cannot make progress (e.g. every client failed in a round)."""


class _GracefulInterrupt:
    """First Ctrl-C: finish the current round (or set-up step), checkpoint, stop. Second Ctrl-C: stop at once."""

    # what the first Ctrl-C waits for, by phase (``phase``: set by the loop as it goes)
    MESSAGES = {
        "round": "finishing this round, writing a checkpoint, then stopping",
        "setup-steps": "finishing this set-up step, writing a checkpoint, then stopping; --resume continues the "
                       "set-up",
        "setup": "this set-up cannot pause part-way: finishing it and round 1, writing a checkpoint, then stopping",
    }

    def __init__(self) -> None:
        self.requested = False
        self.phase = "round"
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not in the main thread
            self._old = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning(f"interrupt: {self.MESSAGES[self.phase]} (Ctrl-C again to abort)")

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class RoundLoop:
    """Runs the rounds of a built run (mixed into ``Simulation``, which sets the attributes below and supplies
    ``checkpoint()``, ``summary()`` and ``abandon()``)."""

    cfg: EasyDict
    task: Task
    device: torch.device
    progress: bool
    is_writer: bool  # rank 0 of a distributed run (or a serial run) writes the run directory
    run_dir: Path
    rundir: RunDirectory
    client_ids: List[int]
    backend: ExecutionBackend
    server: ServerAggregator
    server_ctx: ServerContext
    comm: Communicator
    channel: Any  # the ServerChannel the server strategy sends through
    logger: RunLogger
    history: History
    global_eval: GlobalEvaluation
    completed_round: int
    setup_done: bool
    setup_calls: int  # messages sent during set-up so far (resumed set-up continues their seeds)
    totals: Dict[str, int]
    failures: List[Dict[str, Any]]
    server_stores: ServerStores
    _checkpointed_round: Optional[int]  # the round the last checkpoint written or loaded by this process holds

    def run(self, stop_after: Optional[int] = None,
            on_round: Optional[Callable[[Dict[str, Any]], Optional[bool]]] = None,
            stop_in_setup: Optional[int] = None, on_setup: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
        """Run the remaining rounds (``stop_after``: pause after that round, as an interrupt would; ``on_round``
        receives each round's record and pauses the run after that round by returning True, e.g. a tuner's pruner;
        ``stop_in_setup``: pause after that many resumable set-up steps; ``on_setup`` receives each set-up line,
        with its estimate of the set-up time left, also when the console is quiet)."""
        cfg = self.cfg
        reporter = (RoundReporter if self.is_writer else SilentReporter)(
            self.run_dir, cfg.rounds, self.completed_round, f"{cfg.algorithm}", self.task.metric_name,
            console=self.progress, eval_every=cfg.eval.every, setup_echo=on_setup)
        interrupted = False
        self.current_round = self.completed_round if self.setup_done else 0
        self.rounds_started = False  # a failure from here on keeps the run directory and records why
        try:
            # the run's thread setting holds for its rounds only; the process's own setting comes back afterwards
            with torch_threads(cfg.threads), reporter, _GracefulInterrupt() as stop:
                self._record_run_info(reporter)
                if not self.setup_done:
                    interrupted = not self._run_setup(stop, stop_in_setup, reporter)
                for rnd in ([] if interrupted else range(self.completed_round + 1, cfg.rounds + 1)):
                    self.current_round, self.rounds_started = rnd, True
                    started = time.perf_counter()
                    record = self.run_round(rnd)
                    self.completed_round = rnd
                    reporter.round(record, time.perf_counter() - started, self._postfix(record))
                    asked = on_round is not None and on_round(record) is True
                    last = rnd == cfg.rounds
                    pause = asked or self._stop_requested(stop) or (stop_after is not None and rnd >= stop_after)
                    if (last and cfg.checkpoint.get("final", True)) or pause or \
                            (cfg.checkpoint.every and rnd % cfg.checkpoint.every == 0):
                        self.checkpoint()
                    if pause and not last:
                        interrupted = True
                        break
                reporter.note(f"{'paused' if interrupted else 'finished'} after round {self.completed_round} of "
                              f"{cfg.rounds}")
        except BaseException as exc:
            self.logger.close()
            self._end_stopped(exc)
            raise
        self.logger.close()
        try:
            result = self.summary()
            result["interrupted"] = interrupted
            result["status"] = "interrupted" if interrupted else "finished"
            if self.is_writer:
                _write_summary(self.run_dir, result)
            # finished, and the last checkpoint holds every spilled state: the spill files go (a paused run keeps
            # them: this process may go on)
            if not interrupted and self.completed_round == self._checkpointed_round:
                self._remove_spill_files()
        finally:
            self._release_locks()
        return result

    def _release_locks(self) -> None:
        """The run ends in this process: the run directory's lock and the shared set-up results it was making and
        did not save (core.api.artifacts; a run waiting for one makes it)."""
        try:
            server_ctx = getattr(self, "server_ctx", None)
            if server_ctx is not None:
                server_ctx.artifacts.release()
        finally:
            self.rundir.release()

    def _end_stopped(self, exc: BaseException) -> None:
        """A run that failed (an error) or was stopped at once (a second Ctrl-C, SIGTERM) during ``run``.

        Before round 1 it is a failed start: the directory goes when this start created it and no checkpoint exists
        (``abandon``), and so does a refusal of the configuration (a ``ConfigError``) raised before the first round
        finished, e.g. by a trainer built on its first message. Otherwise (the rounds have started, or the directory
        was there before: a resume, a restart) the directory stays:
        its metrics, run.log and tb/ plus a ``summary.json`` that says how the run ended (status 'failed' with the
        reason, or 'interrupted'), and the last finished round; ``fl run --resume`` continues from its last
        checkpoint. The lock is released either way."""
        refusal = isinstance(exc, ConfigError) and self.completed_round == 0
        goes = self.rundir.created and not checkpoint_exists(self.run_dir) and \
            (refusal or not getattr(self, "rounds_started", False))
        if goes or not self.is_writer:
            self.abandon()  # removes the directory only if this start created it and nothing was saved
            return
        try:
            self._record_stop(exc)
        finally:
            self._release_locks()

    def _record_stop(self, exc: BaseException) -> None:
        failed = isinstance(exc, Exception)
        reason = one_line_reason(exc) if failed else "stopped at once (Ctrl-C pressed twice, or SIGTERM)"
        note = (f"FAILED in round {self.current_round} of {self.cfg.rounds}: {reason}" if failed
                else f"stopped in round {self.current_round} of {self.cfg.rounds}: {reason}")
        try:
            append_run_log(self.run_dir, note)
        except OSError:
            pass
        try:
            result = self.summary()
        except Exception:  # the record must not hide the failure itself
            result = {"run_dir": str(self.run_dir), "algorithm": self.cfg.algorithm,
                      "dataset": self.cfg.dataset.name, "rounds_completed": self.completed_round,
                      "rounds": self.cfg.rounds, "seed": self.cfg.seed}
        comm = getattr(self, "comm", None)
        if comm is not None and self.completed_round < self.current_round:
            # the failing round's rejected replies: its record was never written, so the totals lack them
            result["client_failures"] = int(result.get("client_failures") or 0) + len(comm.traffic.failures)
        # 'interrupted' true as well: a reader that knows only that flag never takes this run for a finished one
        result.update({"interrupted": True, "status": "failed" if failed else "interrupted",
                       "stopped_in_round": self.current_round, "reason": reason})
        try:
            _write_summary(self.run_dir, result)
        except OSError as err:  # e.g. the disk is full: run.log (if it could be written) still says why
            log.warning("cannot write %s: %s", self.run_dir / "summary.json", err)

    def _remove_spill_files(self) -> None:
        """After a clean finish the final checkpoint holds every client's and the server's state: the spill files
        of the declared states (clients.state_memory, server.state_memory) are no longer needed."""
        remove = getattr(self.backend, "remove_spill_files", None)  # each process removes its own
        if callable(remove):
            remove()
        self.server_stores.remove_spill_files()
        if self.is_writer:  # a distributed run's per-rank folders sit in these
            remove_empty_folders([self.run_dir / SPILL_DIR, self.run_dir / SERVER_SPILL_DIR])

    current_round: int  # the round running now (0: set-up), for the record of a failure
    rounds_started: bool

    def _run_setup(self, stop: "_GracefulInterrupt", pause_after: Optional[int], reporter: RoundReporter) -> bool:
        """The set-up phase (round 0); True once complete, False when paused.

        A strategy either has ``setup(channel)``, called once, or ``setup_steps(channel)``: a generator that yields
        after each resumable unit of work (e.g. a block of pre-training steps), keeping its progress in its own
        ``state_dict``. A checkpoint follows every yielded step (when ``checkpoint.every`` > 0, and always before a
        pause); Ctrl-C or ``pause_after`` steps stop between two steps, and a resumed run calls ``setup_steps``
        again, which continues from the saved progress. Set-up messages are numbered continuously across a
        resume, so clients get the same seeds as in an uninterrupted run. Set-up traffic counts in the totals.
        What a step yields (a ``SetupStep`` or a string) goes to run.log and the console as it happens.
        """
        self.logger.set_step(0)
        self.comm.begin_round(0)
        self.comm._calls = self.setup_calls
        # resumable when the strategy's class overrides ServerAggregator.setup_steps (the default calls setup once)
        steps_fn = getattr(type(self.server), "setup_steps", None)
        resumable = steps_fn is not None and steps_fn is not ServerAggregator.setup_steps
        stop.phase = "setup-steps" if resumable else "setup"
        reporter.setup_started(fresh=self.setup_calls == 0)  # set-up resumed part-way has sent messages already
        if not resumable:
            self.server.setup(self.channel)
        else:
            for n, step in enumerate(self.server.setup_steps(self.channel), start=1):
                self._take_setup_traffic()
                if isinstance(step, SetupStep):
                    reporter.setup_step(step.text, step.done, step.total)
                elif isinstance(step, str):
                    reporter.setup_step(step)
                pause = self._stop_requested(stop) or (pause_after is not None and n >= pause_after)
                if pause or self.cfg.checkpoint.every:
                    self.checkpoint()
                if pause:
                    return False
        self._take_setup_traffic()
        self.setup_done = True
        stop.phase = "round"
        reporter.setup_finished()
        return True

    def _take_setup_traffic(self) -> None:
        """Move the set-up traffic so far into the run totals (set-up has no per-round record of its own)."""
        traffic = self.comm.traffic
        self.setup_calls = self.comm._calls
        self.totals["bytes_up"] += traffic.bytes_up
        self.totals["bytes_down"] += traffic.bytes_down
        self.totals["failures"] += len(traffic.failures)
        self.failures.extend(traffic.failures)
        traffic.bytes_up = traffic.bytes_down = 0
        traffic.failures = []

    def run_round(self, rnd: int) -> Dict[str, Any]:
        self.logger.set_step(rnd)
        self.comm.begin_round(rnd)
        self.server_ctx.rng = np.random.default_rng(derive_seed(self.cfg.seed, "server", rnd))
        seed_everything(derive_seed(self.cfg.seed, "server-torch", rnd))
        selected = self.select_clients(rnd)
        start = time.perf_counter()
        self.server.run_round(rnd, selected, self.channel)
        failures = self.comm.traffic.failures
        if failures and not self.comm.traffic.train_replies and len({f["client"] for f in failures}) >= len(selected):
            raise RunFailure(f"every selected client failed in round {rnd}; first failure: client "
                             f"{failures[0]['client']} '{failures[0]['kind']}' {failures[0]['reason']} "
                             f"(run with -v for tracebacks)")
        train_seconds = time.perf_counter() - start
        replies_seen = self.comm.traffic.train_replies
        record: Dict[str, Any] = {
            "clients_selected": len(selected),
            "clients_replied": len(replies_seen),
            "bytes_up": self.comm.traffic.bytes_up,
            "bytes_down": self.comm.traffic.bytes_down,
            "round_seconds": train_seconds,
        }
        if replies_seen:
            n = np.array([r.get("num_samples", 1) for r in replies_seen.values()], dtype=np.float64)
            losses = np.array([r["train_loss"] for r in replies_seen.values()], dtype=np.float64)
            record["train_loss"] = float((n * losses).sum() / n.sum())
            extra: Dict[str, List[float]] = {}
            for r in replies_seen.values():
                for k, v in (r.get("metrics") or {}).items():
                    extra.setdefault(k, []).append(float(v))
            for k, vals in extra.items():
                record[f"clients/{k}"] = float(np.mean(vals))
                self.logger.log_histogram(f"clients/{k}", vals)
        evaluated = rnd % self.cfg.eval.every == 0 or rnd == self.cfg.rounds
        per_client: Dict[str, Any] = {}
        if evaluated:
            ev_start = time.perf_counter()
            summary = self.evaluate_all(rnd)
            record.update(summary)
            record["eval_seconds"] = time.perf_counter() - ev_start
            per_client = getattr(self, "last_per_client", {})
            self.history.add(rnd, summary, per_client.get("per_client"))
            record.update(self.evaluate_global(rnd, summary))  # timed on its own: global_eval_seconds
        for f in self.comm.traffic.failures:
            self.failures.append(f)
        record["client_failures"] = len(self.comm.traffic.failures)
        self.totals["bytes_up"] += record["bytes_up"]
        self.totals["bytes_down"] += record["bytes_down"]
        self.totals["failures"] += record["client_failures"]
        rank_seconds = getattr(self.backend, "take_rank_seconds", None)  # distributed: the assignment's imbalance
        if callable(rank_seconds):
            record.update({f"rank_seconds/{r}": sec for r, sec in enumerate(rank_seconds())})
        self.logger.log_scalars({k: v for k, v in record.items() if isinstance(v, (int, float))})
        # each client's metric and test samples: objects in the record, never TensorBoard scalars
        return self.logger.end_round(per_client if evaluated else None)

    def select_clients(self, rnd: int) -> List[int]:
        """Join ratio, or a per-round ratio drawn from ``random_join_ratio``; seeded by (seed, round)."""
        part = self.cfg.participation
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "select", rnd))
        n = len(self.client_ids)
        ratio = part.join_ratio
        if part.random_join_ratio is not None:
            lo, hi = part.random_join_ratio
            ratio = rng.uniform(lo, hi)
        m = max(1, min(n, int(round(ratio * n))))
        return sorted(int(c) for c in rng.choice(self.client_ids, size=m, replace=False))

    def evaluate_all(self, rnd: int) -> Dict[str, float]:
        messages = self.server.configure_evaluate(rnd, self.client_ids)
        results = self.comm.send(messages, accounted=False)
        if messages and not results:
            failures = self.comm.traffic.failures
            first = (f"; first failure: client {failures[-1]['client']} {failures[-1]['reason']}"
                     if failures else "")
            raise RunFailure(f"every client failed evaluation in round {rnd}{first} (run with -v for tracebacks)")
        summary = summarize(results, self.task.metric_name)
        summary.update(adaptation.cost_summary(results))  # evaluation-time adaptation: steps, seconds, clients
        self.last_per_client = per_client_record(results)  # written into the round's metrics.jsonl record
        self.last_results = results  # the personal replies: a reuse as the global model's numbers is checked on them
        metrics = per_client_metric(results)
        val = per_client_validation(results)
        if val:  # split.val: each client's test metric at its best validation round so far
            self.history.note_clients(rnd, metrics, val)
        if metrics:
            self.logger.log_histogram(f"{self.task.metric_name}/per_client", list(metrics.values()))
        self.global_eval.note_evaluate_messages(messages, self.client_ids)  # what they carried, for a reuse
        return summary

    def evaluate_global(self, rnd: int, personal: Dict[str, float]) -> Dict[str, float]:
        """The global model beside the personal ones (core/engine/globaleval.py): its record keys, {} without one."""
        return self.global_eval.evaluate(rnd, self.server, personal, self.client_ids,
                                         lambda msgs: self.comm.send(msgs, accounted=False),
                                         getattr(self, "last_results", None))

    def _stop_requested(self, stop: "_GracefulInterrupt") -> bool:
        """Ctrl-C seen; in a distributed run, seen by any process (they all stop after the same round)."""
        any_rank = getattr(self.backend, "any_rank", None)
        return any_rank(stop.requested) if callable(any_rank) else stop.requested

    def _record_run_info(self, reporter: RoundReporter) -> None:
        """Append this start or resume to run_info.json (versions, commit, command, threads, device, host)."""
        if not self.is_writer:
            return
        earlier = runinfo.read(self.run_dir)
        fresh = self.completed_round == 0 and not self.setup_done
        event = "start" if not earlier else ("restart" if fresh else "resume")
        entry = runinfo.collect(self.cfg, self.device, effective_threads(self.cfg), event, self.completed_round)
        plan = getattr(self, "batched_plan", None)
        if plan is not None:  # which path the clients' local updates take, and why (clients.batched)
            entry["clients_batched"] = plan.as_dict()
        state_plan = getattr(self, "client_state_plan", None)
        if state_plan is not None:  # pooled trainer with declared states, or one live trainer per client, and why
            entry["clients_state"] = dict(state_plan)
        runinfo.append(self.run_dir, entry)
        reporter.note(f"{event} at round {self.completed_round} of {self.cfg.rounds}: {self.cfg.algorithm} on "
                      f"{self.cfg.dataset.name}, {entry['threads']} torch thread(s), device {entry['device']}, "
                      f"host {entry['hostname']}, command: {entry['command']}")

    def _postfix(self, record: Dict[str, Any]) -> Dict[str, str]:
        m = self.task.metric_name
        out = {}
        if "train_loss" in record:
            out["loss"] = f"{record['train_loss']:.3f}"
        if f"{m}/uniform" in record:
            out[m[:3]] = f"{record[f'{m}/uniform']:.4f}"
        return out


def one_line_reason(exc: BaseException, limit: int = 500) -> str:
    """Why a run failed, in one line: a user-facing error's own message, a bug's type and message."""
    text = str(exc).strip().splitlines()[0].strip() if str(exc).strip() else ""
    line = text if isinstance(exc, PflError) and text else f"{type(exc).__name__}: {text}".rstrip(": ")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _write_summary(run_dir: Path, result: Dict[str, Any]) -> None:
    write_atomic(run_dir / "summary.json", json.dumps(strict_json(result), indent=2, allow_nan=False))
