"""One process of a distributed run: join the process group, build the replicated simulation, run it.

Start-up is ordered so that a failure anywhere is one message and leaves no half-made run directory: rank 0
resolves, checks and prepares the run directory first, then the other ranks build their copy from what it wrote
(its partition, its configuration), and after each step every rank learns whether any rank failed. Only rank 0
prints (errors, progress, the summary); another rank prints only an error that rank 0 cannot know about.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import click
import torch
import torch.distributed as dist

from ..common.errors import ConfigError, PflError
from .backend import DistributedBackend, WorkerLost, device_collective_backend
from .signals import TERMINATED, Terminated, interrupt_requested, orphaned

log = logging.getLogger("pflkit")

INTERRUPTED = 130
USER_ERROR = 2
# seconds a collective may wait for the slowest process (a round's client work included) before the run stops
TIMEOUT_ENV, DEFAULT_TIMEOUT = "PFLKIT_DIST_TIMEOUT", 1800.0
# seconds the processes may take to find each other
RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT = "PFLKIT_RENDEZVOUS_TIMEOUT", 60.0
RUN_DIR_KEY = "/pflkit/run_dir"  # in torchrun's store: the run directory of this launch
# longer waits are a mistake (and overflow the millisecond timers of torch.distributed)
MAX_TIMEOUT = 30 * 24 * 3600.0
MAX_WORLD_SIZE = 65536  # processes of one run (torch.distributed's store handles far fewer in practice)


@dataclass
class RunRequest:
    """What ``fl run`` was asked; every process receives it and resolves the configuration itself."""

    plugin: Optional[str] = None
    config_file: Optional[str] = None
    sets: Tuple[str, ...] = ()
    resume_dir: Optional[str] = None
    progress: bool = True
    status_dir: Optional[str] = None  # fl run --workers: where each rank notes its clients for the launcher
    verbose: bool = False


@dataclass
class Endpoint:
    rank: int
    world_size: int
    local_rank: int
    addr: str
    port: int
    agent_store: bool = False  # torchrun hosts the store itself: every rank connects as a client
    shared_store: Any = None  # that store, which outlives a restart (set by init_group)


def env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT:
        raise ConfigError(f"{name}={text!r}: expected a number of seconds greater than 0 and at most "
                          f"{MAX_TIMEOUT:.0f} (30 days)")
    return value


def check_timeouts() -> None:
    """Reports a bad PFLKIT_DIST_TIMEOUT or PFLKIT_RENDEZVOUS_TIMEOUT before any process starts."""
    env_seconds(RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT)
    env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def parse_port(text: str, name: str = "MASTER_PORT") -> int:
    """A TCP port number from 1 to 65535 (0 would let each process pick its own port: they never meet)."""
    try:
        port = int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a port number (expected an integer from 1 to 65535)") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={text!r}: expected a port number from 1 to 65535")
    return port


def plugin_versions() -> Dict[str, str]:
    """Versions of torch and of every pflkit distribution in this process (compared across ranks)."""
    from importlib.metadata import distributions

    out = {"torch": torch.__version__}
    for d in distributions():
        name = (d.metadata.get("Name") or "").lower()
        if name.startswith("pflkit"):
            out[name] = d.version
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def init_group(ep: Endpoint) -> None:
    """Join the run's gloo process group (client calls exchange pickled CPU data, which gloo carries on CPU and GPU
    machines alike; the NCCL group for device tensors is added once the run's device is known)."""
    rdzv = env_seconds(RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT)
    timeout = env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    try:
        store = dist.TCPStore(ep.addr, ep.port, ep.world_size, is_master=ep.rank == 0 and not ep.agent_store,
                              timeout=timedelta(seconds=rdzv), wait_for_workers=True)
        if ep.agent_store:  # torchrun's store outlives a restart: each attempt keeps its keys apart (as env:// does)
            ep.shared_store = store
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
        dist.init_process_group("gloo", store=store, rank=ep.rank, world_size=ep.world_size,
                                timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"rank {ep.rank}: cannot join the run's processes at {ep.addr}:{ep.port} within "
                          f"{rdzv:g} s ({_first_line(exc)[:200]}); check the rendezvous address and port (torchrun "
                          f"--rdzv-endpoint / MASTER_ADDR, MASTER_PORT) and that every process was started") from None


def _exchange(backend: DistributedBackend, what: str, error: Optional[str], payload: Any = None) -> List[Any]:
    """Every rank's (error, payload); raises the first error on every rank, so all stop together."""
    gathered = backend._all_gather((error, payload), what)
    for r, (err, _) in enumerate(gathered):
        if err is not None:
            raise _Replicated(err if r == 0 else f"rank {r}: {err}")
    return [p for _, p in gathered]


class _Replicated(PflError):
    """An error every rank raises (rank 0 prints it)."""


def _resolve(req: RunRequest):
    from ..engine.config import load_file, parse_sets, resolve

    layers = []
    if req.config_file:
        layers.append(load_file(req.config_file))
    layers.append(parse_sets(req.sets))
    if req.plugin is None and not any("algorithm" in layer for layer in layers):
        raise ConfigError("name an algorithm: fl run --plugin NAME (fl list algorithms shows them)")
    return resolve(layers, algorithm=req.plugin)


def _build(req: RunRequest, backend: DistributedBackend, run_dir: Optional[Path], ep: Endpoint) -> Tuple[Any, bool]:
    """(the simulation, whether it continues an earlier start)."""
    from ..engine.config import parse_sets
    from ..storage.rundir import default_run_dir
    from ..engine.simulation import Simulation

    progress = req.progress and backend.is_writer
    if req.resume_dir:
        if req.plugin or req.config_file:
            raise ConfigError("--resume continues a run with its saved config; do not combine it with "
                              "--plugin or --config (--set may change resume-safe keys such as rounds)")
        return Simulation.resume(Path(req.resume_dir), overrides=parse_sets(req.sets), backend=backend,
                                 progress=progress), True
    cfg = _resolve(req)
    if restarted():  # torchrun --max-restarts started the workers again after a failure: continue the run
        earlier = Path(cfg.output_dir) / cfg.run_name if cfg.run_name else recorded_run_dir(ep)
        if earlier is not None and (earlier / "config.json").is_file():
            return Simulation.resume(earlier, backend=backend, progress=progress), True
    # rank 0 names the directory (a default name holds the time); the others are given it
    return Simulation(cfg, run_dir=run_dir or default_run_dir(cfg), backend=backend, progress=progress), False


def _join_device_group(backend: DistributedBackend, sim: Any) -> None:
    """Every rank picks the backend for device tensors (``distributed.backend``) for its own device; all must agree,
    and with NCCL they create the NCCL group together (a collective)."""
    kind, error = None, None
    try:
        kind = device_collective_backend(sim.cfg.get("distributed", {}).get("backend", "auto"), sim.device)
    except PflError as exc:
        error = str(exc)
    kinds = _exchange(backend, "start-up: collective backend", error, (kind, str(sim.device)))
    for r, (theirs, device) in enumerate(kinds):
        if theirs != kinds[0][0]:
            raise _Replicated(f"rank {r} computes on {device} ({theirs}) but rank 0 on {kinds[0][1]} "
                              f"({kinds[0][0]}): give every machine the same kind of device, or set device=cpu")
    if kind == "nccl":
        group = backend._guard(lambda: dist.new_group(backend="nccl"), "start-up: creating the NCCL group")
        backend.use_device_group(group)


def recorded_run_dir(ep: Endpoint) -> Optional[Path]:
    """The run directory an earlier attempt of this torchrun launch recorded in torchrun's store (a default run
    name holds the start time, so a restarted attempt would otherwise start a new run), or None."""
    if ep.shared_store is None:
        return None
    try:
        if ep.shared_store.check([RUN_DIR_KEY]):
            return Path(ep.shared_store.get(RUN_DIR_KEY).decode())
    except (RuntimeError, OSError, ValueError):
        pass
    return None


def restarted() -> bool:
    """Whether torchrun restarted this process's workers (``--max-restarts``) after a failure."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
    except ValueError:
        return False


def _write_status(req: RunRequest, backend: DistributedBackend, run_dir: Path) -> None:
    """For the launcher of ``fl run --workers``: this rank's clients, so it can name them if this process dies."""
    if not req.status_dir:
        return
    path = Path(req.status_dir) / f"rank{backend.rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"rank": backend.rank, "pid": os.getpid(), "clients": backend.owned,
                                   "run_dir": str(run_dir)}))
        os.replace(tmp, path)
    except OSError:  # the folder went with its launcher: this process is stopping anyway (signals.py)
        pass


def _say(text: str) -> None:
    """One line on stderr, unless the launcher is gone (nobody reads it; the workers only stop)."""
    if not orphaned():
        click.echo(text, err=True)


def run_process(req: RunRequest, ep: Endpoint) -> int:
    """Run this process's part of the run; returns the process's exit status (0, 2 or 130)."""
    log = logging.getLogger("pflkit")
    previous_level = log.level
    if ep.rank != 0:  # the replicated loop logs the same warnings on every rank: rank 0's copy is enough
        log.setLevel(logging.ERROR)
    try:
        return _run_process(req, ep)
    finally:  # a rank run inside another process (tests, threads) must not silence that process's log
        log.setLevel(previous_level)


def _run_process(req: RunRequest, ep: Endpoint) -> int:
    if torch.cuda.is_available():  # device=auto / cuda then means this process's GPU (several may share one)
        torch.cuda.set_device(ep.local_rank % torch.cuda.device_count())
    try:
        init_group(ep)
    except PflError as exc:
        _say(f"Error: {exc}")
        return USER_ERROR
    except Terminated:
        return TERMINATED
    except KeyboardInterrupt:
        if ep.rank == 0 and not req.status_dir:  # fl run --workers: the launcher says it
            _say("interrupted during start-up; nothing was run")
        return INTERRUPTED
    backend = DistributedBackend()
    try:
        try:
            return _run(req, ep, backend)
        except _Replicated as exc:
            if ep.rank == 0:
                _say(f"Error: {exc}")
            _settle(backend)
            return USER_ERROR
        except WorkerLost as exc:  # another process died: each survivor says what it saw
            if interrupt_requested(req.status_dir) or orphaned():
                return INTERRUPTED  # it stopped on the same Ctrl-C (rank 0 says so), or the launcher is gone
            _say(f"Error: {exc}{_lost_resume_hint(backend) if not req.status_dir else ''}")
            return USER_ERROR
        except PflError as exc:
            # raised identically on every rank (the loop is replicated) unless it is rank 0's own file I/O
            if ep.rank == 0:
                _say(f"Error: {exc}")
            _settle(backend)
            return USER_ERROR
        except Terminated:  # SIGTERM or the launcher's death: quietly (the launcher, if any, says why)
            return TERMINATED
        except KeyboardInterrupt:
            if ep.rank == 0 and not (req.status_dir and backend.phase == "start-up"):  # the launcher says that
                _say(_stopped_message(backend))
            return INTERRUPTED
    finally:
        backend.close()
        try:
            dist.destroy_process_group()
        except Exception:  # the group may already be broken by a dead peer: nothing left to release
            pass


def _stopped_message(backend: DistributedBackend) -> str:
    """What rank 0 says when a Ctrl-C stopped this process at once."""
    from ..storage.checkpoint import checkpoint_exists

    run_dir = getattr(backend, "run_dir", None)
    if backend.phase == "start-up" or run_dir is None:
        return "interrupted during start-up; nothing was run"
    if checkpoint_exists(run_dir):
        return f"stopped; continue from the last checkpoint with: fl run --resume {run_dir}"
    if Path(run_dir).is_dir():  # stopped during its rounds: the record stays
        return (f"stopped before the first checkpoint; the record of its rounds stays in {run_dir}; start it again "
                f"from round 0 with: fl run --resume {run_dir}")
    return "stopped before the first checkpoint; nothing to resume"


def _lost_resume_hint(backend: DistributedBackend) -> str:
    """Under torchrun (fl run --workers has its launcher say it): how a survivor's run goes on after a lost node."""
    from ..storage.checkpoint import checkpoint_exists

    run_dir = getattr(backend, "run_dir", None)
    if run_dir is None or not checkpoint_exists(run_dir):
        return ""
    return (f"; continue from the last checkpoint by launching every node again with: torchrun ... -m "
            f"pflkit.core.cli run --resume {run_dir}")


def _settle(backend: DistributedBackend) -> None:
    """Before exiting on an error every rank raised, wait (briefly) for the others, so that a launcher which stops
    the run at the first exiting process does not cut rank 0 off before it printed the error."""
    try:
        work = dist.barrier(async_op=True)
        work.wait(timeout=timedelta(seconds=10))
    except Exception:
        pass


def _run(req: RunRequest, ep: Endpoint, backend: DistributedBackend) -> int:
    versions = plugin_versions()
    gathered = _exchange(backend, "start-up: version check", None, versions)
    for r, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            diff = sorted(k for k in set(theirs) | set(gathered[0]) if theirs.get(k) != gathered[0].get(k))
            k = diff[0]
            raise _Replicated(f"rank {r} runs {k} {theirs.get(k) or '(not installed)'} but rank 0 runs "
                              f"{gathered[0].get(k) or '(not installed)'}: install the same versions on every "
                              f"machine")
    # rank 0 first: it validates the input and prepares the run directory, which the others then read
    sim, error, resumed = None, None, False
    if ep.rank == 0:
        try:
            sim, resumed = _build(req, backend, None, ep)
        except PflError as exc:
            error = str(exc)
    try:
        run_dir = _exchange(backend, "start-up (rank 0)", error, str(sim.run_dir) if sim else None)[0]
        if ep.rank != 0:
            try:
                sim, resumed = _build(req, backend, Path(run_dir), ep)
            except PflError as exc:
                error = str(exc)
        _exchange(backend, "start-up (other ranks)", error)
        _join_device_group(backend, sim)
        backend.run_dir = sim.run_dir  # for the message of an immediate stop (second Ctrl-C)
        _write_status(req, backend, sim.run_dir)
        if ep.rank == 0 and ep.shared_store is not None:  # for a restarted attempt (recorded_run_dir)
            ep.shared_store.set(RUN_DIR_KEY, str(sim.run_dir))
        if ep.rank == 0:
            word = "resuming" if resumed else "run directory:"
            click.echo(f"{word} {sim.run_dir}" + (f" after round {sim.completed_round}" if resumed else "")
                       + f"  ({ep.world_size} processes, {'nccl' if backend.device_group is not None else 'gloo'}; "
                         f"{backend.describe()})")
    except BaseException:  # an error, Ctrl-C or SIGTERM during start-up
        if sim is not None:
            sim.abandon()  # rank 0 removes the directory it created when nothing was saved
        raise
    backend.phase = "the run"
    result = sim.run()
    if ep.rank != 0:
        return INTERRUPTED if result.get("interrupted") else 0
    from ..storage.reporting import report_result

    return INTERRUPTED if report_result(result, sim.run_dir) else 0


def torchrun_endpoint() -> Optional[Endpoint]:
    """This process's place in a torchrun (or any env://-style) launch, from RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT; None when they are not all set."""
    env = os.environ
    if not all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None
    port = parse_port(env["MASTER_PORT"])
    if not 1 <= world <= MAX_WORLD_SIZE or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank}, WORLD_SIZE={world}: the rank must lie in [0, WORLD_SIZE) and WORLD_SIZE "
                          f"in [1, {MAX_WORLD_SIZE}]")
    if local < 0:
        raise ConfigError(f"LOCAL_RANK={local}: expected a rank of at least 0")
    check_timeouts()
    return Endpoint(rank, world, local, env["MASTER_ADDR"], port,
                    agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
