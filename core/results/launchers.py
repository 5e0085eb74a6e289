"""The runs of a comparison as jobs of a cluster, through submitit (``--launcher slurm``; ``submitit-local`` runs the
same code with subprocesses instead of Slurm, for tests and for trying a submission on one machine).

Each pending run is one task of a job array. ``fl compare`` / ``fl reproduce`` return after submitting, printing
the job ids and how to watch and collect; running the same command again collects the finished runs (the usual reuse
and verification), resubmits the failed or missing ones, and leaves alone a run whose job is still queued or running
(``OUT/jobs.json`` records which job each run was given). A job that Slurm preempts or times out is requeued by
submitit (``RunJob.checkpoint``) and resumes from the run's last checkpoint: pflkit's resume is bit-identical, so a
requeued run ends with the numbers of an uninterrupted one. Every job first checks that it can write its run
directory (which must sit on a file system the jobs share); a job's stdout and stderr are in ``OUT/jobs/``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import ConfigError
from ..common.safefiles import write_atomic
from ..storage.runinfo import ENV_JOB

LAUNCHERS = ("slurm", "submitit-local")
JOBS_NAME = "jobs.json"
LOCK_NAME = "jobs.lock"
JOBS_FOLDER = "jobs"
# states of a recorded job that mean "leave it alone": it will still run (Slurm's names; LocalJob says RUNNING)
ALIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
         "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "UNKNOWN"}


@dataclass
class LauncherSettings:
    """Where and with what the jobs run (``--launcher`` and its ``--slurm-*`` options)."""

    name: str
    partition: Optional[str] = None
    time_min: int = 60
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    mem_gb: Optional[float] = None
    account: Optional[str] = None
    array_parallelism: int = 256
    extra: Dict[str, str] = field(default_factory=dict)  # more sbatch options: {"qos": "high", ...}

    def __post_init__(self) -> None:
        if self.name not in LAUNCHERS:
            raise ConfigError(f"--launcher {self.name!r}: expected one of {', '.join(LAUNCHERS)}")
        for key in ("time_min", "cpus_per_job", "array_parallelism"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"launcher {key}: must be a positive integer, got {value!r}")
        if isinstance(self.gpus_per_job, bool) or not isinstance(self.gpus_per_job, int) or self.gpus_per_job < 0:
            raise ConfigError(f"launcher gpus_per_job: must be an integer >= 0, got {self.gpus_per_job!r}")
        if self.mem_gb is not None and not (isinstance(self.mem_gb, (int, float)) and self.mem_gb > 0):
            raise ConfigError(f"launcher mem_gb: must be > 0, got {self.mem_gb!r}")

    def executor(self, folder: Path) -> Any:
        """The submitit executor of these settings (one clear line when submitit or Slurm is missing)."""
        try:
            import submitit
        except ImportError:
            raise ConfigError("--launcher needs submitit: pip install \"pflkit[slurm]\" (or pip install submitit)"
                              ) from None
        if self.name == "slurm":
            if shutil.which("sbatch") is None:
                raise ConfigError("--launcher slurm: no sbatch on this machine's PATH (is this a Slurm login node?); "
                                  "--launcher submitit-local runs the same jobs as local processes")
            try:
                executor: Any = submitit.SlurmExecutor(folder=str(folder))
            except RuntimeError as exc:  # submitit's own check of the cluster (no srun beside sbatch)
                raise ConfigError(f"--launcher slurm: {exc}") from None
            params: Dict[str, Any] = {"time": self.time_min, "cpus_per_task": self.cpus_per_job,
                                      "array_parallelism": self.array_parallelism, "signal_delay_s": 120}
            if self.gpus_per_job:
                params["gpus_per_node"] = self.gpus_per_job
            if self.partition:
                params["partition"] = self.partition
            if self.mem_gb is not None:
                params["mem"] = f"{int(self.mem_gb * 1024)}MB"
            if self.account:
                params["account"] = self.account
            if self.extra:
                params["additional_parameters"] = dict(self.extra)
            executor.update_parameters(**params)
        else:
            executor = submitit.LocalExecutor(folder=str(folder))
            executor.update_parameters(timeout_min=self.time_min, cpus_per_task=self.cpus_per_job,
                                       gpus_per_node=self.gpus_per_job)
        return executor


class RunJob:
    """What one job runs: one pflkit run, started or resumed from its run directory. ``checkpoint`` is submitit's
    hook on preemption or time-out: the job is requeued with the same arguments and resumes the run."""

    def __call__(self, cfg: Any, run_dir: str) -> Dict[str, Any]:
        from ..storage.checkpoint import checkpoint_exists
        from .compare import _execute, _one_torch_thread

        path = Path(run_dir)
        probe = path.parent / f".{path.name}.writable"
        try:  # the run directory must be writable from the job's machine (a shared file system)
            path.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text(os.environ.get("SLURM_JOB_ID", "local"))
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"this job cannot write {path.parent} ({exc.strerror}): the output folder must be on a "
                              f"file system the jobs share") from None
        os.environ[ENV_JOB] = json.dumps(_job_record())  # run_info.json names the job and its stdout / stderr
        state = "resume" if path.is_dir() and checkpoint_exists(path) else None
        if state is None and path.exists():  # a start that never checkpointed: start it afresh
            shutil.rmtree(path)
        preempted = _Preemption()
        with preempted, _one_torch_thread():
            try:
                summary = _execute(cfg, path, state, False)
            except KeyboardInterrupt:  # the signal came before the run's own Ctrl-C handling was in place
                if not preempted.signum:
                    raise
                summary = {"interrupted": True}
        if preempted.signum:  # now, outside the run: submitit's checkpoint() -> requeue, and this job exits
            preempted.hand_over()
        if not summary.get("interrupted") and summary.get("status") != "failed":
            from .compare import record_verified

            record_verified(path)  # what the comparing process records when it sees a run finish (this user's key)
        return summary

    def checkpoint(self, cfg: Any, run_dir: str) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, cfg, run_dir)


def _job_record() -> Dict[str, Any]:
    """The running job's id and the files its stdout and stderr go to (submitit's job environment)."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        return {"id": str(env.job_id), "stdout": str(env.paths.stdout), "stderr": str(env.paths.stderr)}
    except Exception:  # not inside a submitit job (a direct call): nothing to point to
        return {"id": None}


class _Preemption:
    """While a run computes, Slurm's preemption / time-out signal asks the run to stop the way Ctrl-C does (finish
    the round, write a checkpoint, return): submitit's own handler would raise SystemExit wherever the signal lands,
    inside a client's training (where pflkit isolates client errors, so the run would go on). After the run has
    stopped, ``hand_over`` gives the signal to submitit's handler: checkpoint() and requeue."""

    def __init__(self) -> None:
        self.signum = 0
        self._usr = None
        self._submitit = None

    def __enter__(self) -> "_Preemption":
        import signal

        try:
            import submitit

            self._usr = submitit.JobEnvironment._usr_sig()  # SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise
        except Exception:  # not inside a submitit job, or an older submitit: Slurm's default
            self._usr = signal.SIGUSR2
        try:
            self._submitit = signal.signal(self._usr, self._on_signal)
        except ValueError:  # not the main thread: leave submitit's handling as it is
            self._usr = None
        return self

    def _on_signal(self, signum, frame) -> None:
        import signal

        self.signum = signum
        os.kill(os.getpid(), signal.SIGINT)  # the run's graceful stop: this round, a checkpoint, then return

    def __exit__(self, *exc) -> bool:
        import signal

        if self._usr is not None:
            signal.signal(self._usr, self._submitit)
        return False

    def hand_over(self) -> None:
        if callable(self._submitit):
            self._submitit(self.signum, None)


def read_jobs(out_dir: Path) -> Dict[str, Dict[str, Any]]:
    """run directory name -> {launcher, job_id, folder} of the jobs submitted earlier ({} when none)."""
    try:
        data = json.loads((Path(out_dir) / JOBS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def job_state(record: Mapping[str, Any]) -> str:
    """The state of an earlier job: Slurm's (sacct), or for a local job whether its process still runs."""
    if record.get("launcher") == "slurm":
        try:
            import submitit

            return str(submitit.SlurmJob(folder=record["folder"], job_id=str(record["job_id"])).state)
        except Exception:  # sacct unreachable: assume it may still run (never submit a run twice)
            return "UNKNOWN"
    pid = record.get("pid")
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/cmdline", "rb") as fh:  # the pid is still the job's, not a reused one
                if b"submitit" in fh.read():
                    return "RUNNING"
        except (OSError, ProcessLookupError):
            pass
    return "FINISHED"


def submit(pending: Sequence[Tuple[Any, int, Any, Path, Optional[str]]], out_dir: Path,
           settings: LauncherSettings, echo: Callable[[str], None]) -> Tuple[List[Any], List[Path]]:
    """Submit one job-array task per pending run that no live job holds; returns (the new jobs, the runs left alone
    because their job is queued or running)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _collector_lock(out_dir):
        return _submit(pending, out_dir, settings, echo)


@contextlib.contextmanager
def _collector_lock(out_dir: Path) -> Iterator[None]:
    """One collector at a time per output folder: a second would submit the same runs again."""
    import fcntl

    path = out_dir / LOCK_NAME
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"another fl compare / fl reproduce is submitting or collecting the runs of {out_dir} "
                              f"(it holds {path}); wait for it, then run this command again") from None
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _submit(pending: Sequence[Tuple[Any, int, Any, Path, Optional[str]]], out_dir: Path,
            settings: LauncherSettings, echo: Callable[[str], None]) -> Tuple[List[Any], List[Path]]:
    records = read_jobs(out_dir)
    todo, waiting = [], []
    for _, _, cfg, run_dir, _ in pending:
        record = records.get(run_dir.name)
        if record is not None and job_state(record) in ALIVE:
            waiting.append(run_dir)
            continue
        if record is not None:  # its job ended without a finished run: say where its output is, then resubmit
            echo(f"{run_dir.name}: job {record.get('job_id')} ended without finishing the run (its output: "
                 f"{Path(str(record.get('folder', out_dir / JOBS_FOLDER)))}/{record.get('job_id')}_0_log.err); "
                 f"submitting it again" + (", to resume from its checkpoint" if (run_dir / "checkpoint.pt").exists()
                                           else ""))
        todo.append((cfg, run_dir))
    jobs: List[Any] = []
    if todo:
        folder = out_dir / JOBS_FOLDER
        executor = settings.executor(folder)
        try:
            jobs = executor.map_array(RunJob(), [cfg for cfg, _ in todo], [str(run_dir) for _, run_dir in todo])
        except Exception as exc:  # sbatch refused (a partition that does not exist, an account...)
            raise ConfigError(f"--launcher {settings.name}: submitting {len(todo)} job(s) failed: "
                              f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
                              ) from None
        for (_, run_dir), job in zip(todo, jobs):
            record = {"launcher": settings.name, "job_id": str(job.job_id), "folder": str(folder)}
            process = getattr(job, "_process", None)
            if process is not None:
                record["pid"] = int(process.pid)
            records[run_dir.name] = record
        write_atomic(out_dir / JOBS_NAME, json.dumps(records, indent=2, sort_keys=True))
    return jobs, waiting
