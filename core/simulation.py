"""The federated simulation: build clients and server, run rounds, evaluate every client, log, checkpoint."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import time
from datetime import datetime
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from easydict import EasyDict

from . import adaptation, compose
from . import registry as reg
from .backend import ExecutionBackend, SerialBackend, StateOptions, TrainerFactory
from .checkpoint import (CHECKPOINT_NAME, check_header, check_run_state, checkpoint_exists, open_checkpoint,
                         remove_orphaned_temporaries, save_checkpoint)
from .clientstate import SPILL_DIR, parse_size
from .serverstore import BUDGET_KEY as SERVER_BUDGET_KEY, SERVER_SPILL_DIR, ServerStores
from .client import ClientContext, can_pool
from .comm import Communicator
from .config import check_resume_overrides, config_fingerprint, deep_merge, to_plain
from .data import FederatedData, build_federated_data
from .errors import CheckpointError, ConfigError, DataError, PflError
from .evaluation import History, per_client_metric, summarize
from .distributed.assign import sgd_steps_per_epoch
from .distributed.silent import SilentReporter, SilentRunLogger
from .monitor import RoundReporter, RunLogger, append_run_log
from .privacy import PrivacyGuard
from .rundir import RunDirLock
from .safefiles import check_run_dir, open_append, read_regular, remove_temporaries, unlink_entry, write_atomic
from .seeding import derive_seed, rng_state, seed_everything, set_rng_state
from .server import ServerContext, SetupStep
from .threads import effective_threads, torch_threads
from . import runinfo

log = logging.getLogger("pflkit")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device: {name!r} is not a torch device ({exc})") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available (use device=cpu or auto)")
    return dev


def make_model_factory(cfg: EasyDict, input_shape, output_dim: int, device: torch.device) -> Callable[[], torch.nn.Module]:
    """Every call returns the same initial weights (seeded), on ``device``: clients and server start equal.

    The weights follow ``model.init_seed`` when set (so ``init_seed=s`` reproduces the initial model of a run with
    ``seed=s`` while everything else follows the run seed), else the run seed."""
    builder = reg.MODELS.get(cfg.model.name)
    args = {k: v for k, v in cfg.model.items() if k not in ("name", "init_seed")}
    init_seed = derive_seed(cfg.seed if cfg.model.get("init_seed") is None else cfg.model.init_seed, "model-init")

    def build() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = builder(input_shape=tuple(input_shape), num_classes=output_dim, **args)
        return model.to(device)

    return build


def check_model_fits_data(cfg: EasyDict, build_model: Callable[[], torch.nn.Module], data: FederatedData,
                          device: torch.device) -> None:
    """Build the model and run it on two real samples, so a model/data mismatch is one clear error up front."""
    bundle = data.bundle
    try:
        model = build_model()
    except Exception as exc:
        raise ConfigError(f"model '{cfg.model.name}' cannot be built for inputs of shape "
                          f"{tuple(bundle.input_shape)} with {bundle.task.output_dim} outputs: "
                          f"{type(exc).__name__}: {exc}") from exc
    x = bundle.x[:2].to(device)
    if bundle.transform is not None:
        x = bundle.transform(x)
    try:
        with torch.no_grad():
            model.eval()
            out = model(x)
    except Exception as exc:
        raise ConfigError(f"model '{cfg.model.name}' does not fit dataset '{cfg.dataset.name}' (inputs of shape "
                          f"{tuple(bundle.input_shape)}, dtype {x.dtype}): {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}") from exc
    if bundle.task.kind == "classification" and (out.ndim != 2 or out.shape[1] != bundle.task.output_dim):
        raise ConfigError(f"model '{cfg.model.name}' outputs shape {tuple(out.shape[1:])} per sample; dataset "
                          f"'{cfg.dataset.name}' needs {bundle.task.output_dim} class scores")


def default_run_dir(cfg: EasyDict) -> Path:
    """``output_dir/run_name``; without a run_name, ``<algorithm>-<dataset>-<time>`` made unique with a suffix."""
    if cfg.run_name:
        return Path(cfg.output_dir) / cfg.run_name
    base = Path(cfg.output_dir) / f"{cfg.algorithm}-{cfg.dataset.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


# What a run directory holds before its first checkpoint (besides checkpoint temporaries)
_START_ARTEFACTS = {".lock", "config.json", "partition.json", "metrics.jsonl", "summary.json", "run.log",
                    "run_info.json", "run_info.json.tmp", "resumes.jsonl", "tb"}
# pflkit's own files and folders in a run directory: each must be a regular file / a real directory of regular
# files, never a link or a FIFO planted there (a resume or a reusing start would write through it)
RUN_FILES = (".lock", "config.json", "partition.json", "metrics.jsonl", "summary.json", "run.log", "run_info.json",
             "resumes.jsonl", CHECKPOINT_NAME)
RUN_DIRS = ("tb", SPILL_DIR, SERVER_SPILL_DIR)
_MAX_CONFIG_BYTES = 16 << 20


def check_own_entries(run_dir: Path) -> None:
    """Refuse (one line naming it) a run directory where one of pflkit's own files or folders is a link, FIFO or
    device: called before a resume or a start reusing the directory writes anything."""
    check_run_dir(run_dir, RUN_FILES, RUN_DIRS)


def _readable_config(path: Path) -> bool:
    try:
        return isinstance(json.loads(read_regular(path / "config.json", _MAX_CONFIG_BYTES).decode("utf-8")), dict)
    except (OSError, ValueError, PflError):
        return False


def is_dead_start(path: Path) -> bool:
    """A run directory left by a start that was killed before it had anything to resume: no checkpoint, no
    readable config.json, and nothing but pflkit's own start-up files. A new start may reuse it (after
    ``check_own_entries``)."""
    if not path.is_dir() or path.is_symlink() or os.path.lexists(path / CHECKPOINT_NAME) or _readable_config(path):
        return False
    return all(p.name in _START_ARTEFACTS or p.name in (SPILL_DIR, SERVER_SPILL_DIR) or p.name.endswith(".tmp")
               for p in path.iterdir())


def prepare_run_dir(path: Path, exist_ok: bool = False) -> Path:
    if exist_ok and not path.is_dir():
        raise CheckpointError(f"{path} is not a run directory")
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError as exc:
        raise CheckpointError(f"run directory {path} already exists; choose another run_name, or resume it with "
                              f"'fl run --resume {path}'") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot create run directory {path}: {exc.strerror}") from exc
    if not os.access(path, os.W_OK):
        raise CheckpointError(f"run directory {path} is not writable")
    return path


def strict_json(obj: Any) -> Any:
    """``obj`` with NaN/Infinity replaced by null, so the file is strict JSON (other tools reject bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


class _ClientStatesView(Mapping):
    """cid -> what the backend keeps for that client, fetched only when asked for (checkpoints stream it)."""

    def __init__(self, backend: ExecutionBackend, client_ids: List[int]) -> None:
        self._backend, self._ids = backend, list(client_ids)

    def __getitem__(self, cid: int) -> Any:
        return self._backend.get_state(cid)

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class RunFailure(PflError):
    """The run cannot make progress (e.g. every client failed in a round)."""


class _GracefulInterrupt:
    """First Ctrl-C: finish the current round, checkpoint, stop. Second Ctrl-C: stop at once."""

    def __init__(self) -> None:
        self.requested = False
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
        log.warning("interrupt: finishing this round, writing a checkpoint, then stopping (Ctrl-C again to abort)")

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class Simulation:
    """One federated run. ``Simulation(cfg).run()`` or ``Simulation.resume(run_dir).run()``."""

    def __init__(self, cfg: EasyDict, run_dir: Optional[Path] = None, backend: Optional[ExecutionBackend] = None,
                 data: Optional[FederatedData] = None, _resume_state: Optional[Dict[str, Any]] = None,
                 progress: bool = False, tensorboard: bool = True, _restart: bool = False,
                 _partition_sha256: Optional[str] = None):
        self.cfg = cfg
        self.progress = progress
        self.device = resolve_device(cfg.device)
        # a distributed run replicates this loop on every process; only the writer (rank 0) writes the run directory
        self.is_writer = bool(getattr(backend, "is_writer", True))
        resuming = _resume_state is not None
        reuse_dir = resuming or _restart  # _restart: a run that died before its first checkpoint starts over
        run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        seed_everything(cfg.seed)

        # data and model are checked before anything is written, so bad input leaves no run directory behind;
        # a resumed run reloads its saved partition
        splits = None
        if (reuse_dir or not self.is_writer) and (run_dir / "partition.json").exists():
            try:
                splits = FederatedData.load_splits(run_dir / "partition.json")
            except DataError:
                if not _restart:
                    raise
                # nothing was computed on it yet: the configuration makes the same partition again
                log.warning("%s is damaged and the run has no checkpoint: making its partition again from its "
                            "configuration", run_dir / "partition.json")
        self.data = data if data is not None else build_federated_data(cfg, splits=splits)
        self.partition_sha256 = self.data.fingerprint()
        if _partition_sha256 is not None and _partition_sha256 != self.partition_sha256:
            raise CheckpointError(f"{run_dir / 'partition.json'} does not match {run_dir / CHECKPOINT_NAME}: the "
                                  f"partition was edited after the checkpoint was written (clients' samples moved "
                                  f"or swapped); restore the original partition.json")
        bundle = self.data.bundle
        self.task = bundle.task
        self.build_model = make_model_factory(cfg, bundle.input_shape, bundle.task.output_dim, self.device)
        check_model_fits_data(cfg, self.build_model, self.data, self.device)
        self.client_ids = list(range(self.data.num_clients))

        # a directory left by a start killed before it wrote its configuration holds nothing to resume: reuse it
        dead = self.is_writer and not reuse_dir and is_dead_start(run_dir)
        if self.is_writer and (reuse_dir or dead):
            check_own_entries(run_dir)  # nothing is written through a link planted in a reused directory
        if dead:
            log.warning("%s holds no run (no configuration, no checkpoint: a start stopped early): reusing it",
                        run_dir)
        # the other processes of a distributed run use the directory rank 0 prepared, and only read it
        self.run_dir = prepare_run_dir(run_dir, exist_ok=reuse_dir or dead) if self.is_writer else run_dir
        self._created_dir = self.is_writer and not reuse_dir and not dead  # never remove one another start holds
        self._lock = RunDirLock(self.run_dir)
        try:
            if self.is_writer:
                self._lock.acquire()
                remove_orphaned_temporaries(self.run_dir)
                remove_temporaries(self.run_dir, RUN_FILES)  # of a rewrite that was killed
                if _restart or dead:
                    for name in ("metrics.jsonl", "summary.json"):
                        unlink_entry(self.run_dir / name)
                    shutil.rmtree(self.run_dir / "tb", ignore_errors=True)  # checked: a real directory
                if not resuming:
                    write_atomic(self.run_dir / "config.json", json.dumps(to_plain(cfg), indent=2))
                    self.data.save(self.run_dir / "partition.json")
            self._start(cfg, backend, _resume_state, tensorboard)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Give the run directory up after a failed start: release the lock and, when this start created the
        directory and no checkpoint exists yet, remove it (a failed start leaves nothing half-made behind)."""
        logger = getattr(self, "logger", None)
        if logger is not None:
            logger.close()
        self._lock.release()
        if self._created_dir and not checkpoint_exists(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _start(self, cfg: EasyDict, backend: Optional[ExecutionBackend], _resume_state: Optional[Dict[str, Any]],
               tensorboard: bool) -> None:
        resuming = _resume_state is not None

        composition = compose.composition(cfg)  # an augmenting algorithm (PCFL(FedAvg), ...) is composed here
        self.trainer_cls, self.aggregator_cls = composition.trainer, composition.aggregator
        # the base algorithm an augmenting one wraps, as "SECTION.base" -> name (summary.json and the printed summary)
        self.base_algorithm = ({f"{composition.section}.{compose.BASE_KEY}": composition.base}
                               if composition.wrapped else {})
        trainer_hp = EasyDict({k: v for k, v in cfg.trainer.items() if k != "name"})
        self._trainer_hp = trainer_hp

        # clients: each context holds that client's tensors only; the guard fingerprints them once. A backend that
        # runs clients in several processes names this process's clients: only their data is built here
        self.backend = backend or SerialBackend()
        local = set(self.backend.assign({cid: sgd_steps_per_epoch(len(self.data.splits[cid].train),
                                                                  cfg.train.batch_size) for cid in self.client_ids}))
        self.guard = PrivacyGuard()
        self.contexts: Dict[int, ClientContext] = {}
        adapt = adaptation.settings_from_config(cfg)  # eval.adapt*: applied by each client's on_evaluate
        adaptation.check_model(self.trainer_cls, self.build_model, adapt)
        for cid in (c for c in self.client_ids if c in local):
            train, test = self.data.client_tensors(cid, self.device)
            self.guard.register(cid, [train.x, test.x], [train.y, test.y])
            self.contexts[cid] = ClientContext(
                cid=cid, train=train, test=test, task=self.task, device=self.device, hp=trainer_hp,
                train_cfg=cfg.train, build_model=self.build_model, num_clients=len(self.client_ids), seed=cfg.seed,
                adaptation=adapt)
        # the backend owns the clients' state: one live trainer each, or (a trainer that declares its state) a
        # pooled working trainer plus a store of declared states with a memory budget
        state_opts = StateOptions(parse_size(cfg.get("clients", {}).get("state_memory")), self.run_dir / SPILL_DIR)
        pooled = can_pool(self.trainer_cls, self.aggregator_cls)
        # failures.client_timeout (.get: a run saved before the key existed has no limit)
        limit_calls = getattr(self.backend, "limit_calls", None)  # an ExecutionBackend's; a duck-typed one has none
        if callable(limit_calls):
            limit_calls(cfg.failures.get("client_timeout"), self.run_dir)
        self.backend.start(TrainerFactory(self.trainer_cls, self.contexts, pooled), self.client_ids, state_opts)

        self.logger = (RunLogger if self.is_writer else SilentRunLogger)(
            self.run_dir, resume_from_round=_resume_state["round"] if resuming else None, tensorboard=tensorboard)
        shared_keys = None
        shared_fn = getattr(self.trainer_cls, "shared_keys", None)
        if callable(shared_fn):
            shared_keys = shared_fn(self.build_model(), trainer_hp)
        # the server's per-client stores (core.serverstore): one budget, spilled under the run directory (each rank
        # of a distributed run replicates the server, so each spills to its own folder); stale spill files of an
        # earlier process go (the checkpoint holds the entries)
        rank = getattr(self.backend, "rank", None)
        server_spill = self.run_dir / SERVER_SPILL_DIR
        self.server_stores = ServerStores(
            parse_size(cfg.get("server", {}).get("state_memory"), SERVER_BUDGET_KEY),
            server_spill / f"rank{rank}" if isinstance(rank, int) else server_spill)
        self.server_stores.clear()
        self.server_ctx = ServerContext(
            hp=EasyDict({k: v for k, v in cfg.aggregator.items() if k != "name"}), cfg=cfg, task=self.task,
            num_clients=len(self.client_ids), build_model=self.build_model, shared_keys=shared_keys,
            device=self.device, seed=cfg.seed, logger=self.logger, rng=np.random.default_rng(cfg.seed),
            data_info={"dataset": cfg.dataset.name, "input_shape": tuple(self.data.bundle.input_shape),
                       "meta": self.data.bundle.meta}, stores=self.server_stores)
        self.server = self.aggregator_cls(self.server_ctx)
        # the aggregator's declared mean fields are folded as replies arrive (streaming aggregation); with
        # distributed.exact false each rank folds its own clients and the ranks all-reduce the sums; .get: a run
        # saved before the key existed resumes exact
        exact = bool(cfg.get("distributed", {}).get("exact", True))
        self.comm = Communicator(self.backend, self.client_ids, cfg.seed, self.guard,
                                 cfg.failures.on_client_error, cfg.failures.rollback,
                                 mean_fields=getattr(self.aggregator_cls, "reduced_fields", tuple)(),
                                 reduce_across_ranks=not exact,
                                 reply_weight=getattr(self.server, "reply_weight", None))
        self.channel = self.comm.channel()  # all the server strategy gets: it can send, nothing more
        self.history = History(self.task.metric_name, self.task.higher_is_better)
        self.completed_round = 0
        self.setup_done = False
        self.setup_calls = 0  # messages sent during set-up so far (resumed set-up continues their seeds)
        self.totals = {"bytes_up": 0, "bytes_down": 0, "failures": 0}
        self.failures: List[Dict[str, Any]] = []
        if resuming:
            self._restore(_resume_state)
        else:
            self.logger.log_text("config", "```\n" + json.dumps(to_plain(cfg), indent=2) + "\n```")

    # -- resume ------------------------------------------------------------------------------------------------
    @classmethod
    def resume(cls, run_dir: Path, overrides: Optional[Dict[str, Any]] = None, **kwargs) -> "Simulation":
        """Continue the run in ``run_dir`` from its checkpoint; ``overrides`` may change resume-safe keys only.

        The checkpoint must match ``config.json`` (its header holds the configuration's hash), so an edited
        configuration or a checkpoint copied from another run is refused. A run that died before its first
        checkpoint starts again from round 0 in the same directory, with its saved configuration and partition.
        """
        from .config import resolve

        run_dir = Path(run_dir)
        cfg_path = run_dir / "config.json"
        if run_dir.is_dir():
            check_own_entries(run_dir)  # before anything is read or written there
        if is_dead_start(run_dir):
            raise CheckpointError(f"{run_dir} has nothing to resume: its run was stopped while starting, before it "
                                  f"saved its configuration. Start it again with the original fl run command (the "
                                  f"same run_name reuses this directory)")
        if not run_dir.is_dir() or not cfg_path.is_file():
            raise CheckpointError(f"{run_dir} is not a run directory (no config.json)")
        try:
            saved = json.loads(read_regular(cfg_path, _MAX_CONFIG_BYTES).decode("utf-8"))
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{cfg_path} is corrupt ({exc}); restore it from a copy") from None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{cfg_path} is corrupt (not a JSON object); restore it from a copy")
        overrides = dict(overrides or {})
        check_resume_overrides(overrides)
        cfg = resolve([deep_merge(saved, overrides)])
        if not checkpoint_exists(run_dir):
            log.warning("%s has no checkpoint (the run stopped before its first one): starting it again from "
                        "round 0 with its saved configuration and partition", run_dir)
            sim = cls(cfg, run_dir=run_dir, _restart=True, **kwargs)
            if sim.is_writer:
                sim._record_resume(overrides, 0)
            return sim
        header, state = open_checkpoint(run_dir)  # client states are read one at a time while restoring
        check_header(header, run_dir / CHECKPOINT_NAME)
        if header.get("config_sha256") != config_fingerprint(cfg):
            raise CheckpointError(
                f"{cfg_path} does not match {run_dir / 'checkpoint.pt'} (checkpoint of algorithm "
                f"'{header.get('algorithm')}' after round {header.get('round')}): the configuration was edited "
                f"after the checkpoint was written, or the checkpoint belongs to another run. Restore the original "
                f"config.json; change only resume-safe keys, with --set on the resume command")
        check_run_state(state, header, run_dir / CHECKPOINT_NAME)
        done = header["round"]
        if cfg.rounds < done:
            raise ConfigError(f"rounds: {cfg.rounds} is invalid: the run has already completed {done} rounds")
        threads, now = header.get("torch_threads"), effective_threads(cfg)
        warning = None
        if threads is not None and threads != now:
            warning = (f"this run was checkpointed with {threads} torch threads and resumes with {now}: numbers will "
                       f"differ from an uninterrupted run from round {done + 1} on (resume with --set "
                       f"threads={threads} to match)")
            log.warning(warning)
        sim = cls(cfg, run_dir=run_dir, _resume_state=state, _partition_sha256=header.get("partition_sha256"),
                  **kwargs)
        if not sim.is_writer:
            return sim
        sim._record_resume(overrides, done)
        if warning:
            append_run_log(run_dir, f"WARNING pflkit: {warning}")
        return sim

    def _record_resume(self, overrides: Dict[str, Any], from_round: int) -> None:
        """Keep the run directory truthful: config.json holds the values in force, resumes.jsonl the history."""
        if overrides:
            write_atomic(self.run_dir / "config.json", json.dumps(to_plain(self.cfg), indent=2))
        entry = {"time": datetime.now().isoformat(timespec="seconds"), "from_round": from_round,
                 "overrides": overrides, "torch_threads": effective_threads(self.cfg)}
        with open_append(self.run_dir / "resumes.jsonl") as f:
            f.write(json.dumps(entry) + "\n")

    def _state(self) -> Dict[str, Any]:
        stores = self.server_stores.checkpoint_view()  # streamed one entry at a time, like the clients
        return {
            **({"server_stores": stores} if stores else {}),
            "round": self.completed_round,
            "setup_done": self.setup_done,
            "setup_calls": self.setup_calls,
            "server": self.server.state_dict(),
            "clients": _ClientStatesView(self.backend, self.client_ids),  # written one client at a time
            "history": self.history.state_dict(),
            "totals": dict(self.totals),
            "failures": list(self.failures),
            "rng": rng_state(),
        }

    def _restore(self, state: Dict[str, Any]) -> None:
        path = self.run_dir / "checkpoint.pt"
        try:
            self._load_state(state)
        except PflError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); it was written by "
                                  f"another algorithm or pflkit version") from None

    def _load_state(self, state: Dict[str, Any]) -> None:
        if set(state["clients"]) != set(self.client_ids):
            raise CheckpointError(f"checkpoint {self.run_dir / 'checkpoint.pt'} does not fit this run: its clients "
                                  f"do not match the run's partition")
        # the server's per-client stores first: an aggregator's load_state_dict may consult them
        self.server_stores.load(state.get("server_stores") or {}, self.run_dir / CHECKPOINT_NAME)
        self.server.load_state_dict(state["server"])
        holds = getattr(self.backend, "holds", None)  # a distributed rank reads only its own clients' states
        for cid in state["clients"]:
            if holds is None or holds(cid):
                self.backend.set_state(cid, state["clients"][cid])
        self.history.load_state_dict(state["history"])
        self.completed_round = int(state["round"])
        self.setup_done = bool(state["setup_done"])
        self.setup_calls = int(state.get("setup_calls", 0))
        self.totals = dict(state["totals"])
        self.failures = list(state["failures"])
        set_rng_state(state["rng"])

    def checkpoint(self) -> None:
        if not self.is_writer:  # rank 0 writes; the others send it their clients' states, in the same order
            for cid in self.client_ids:
                self.backend.get_state(cid)
            return
        meta = {"config_sha256": config_fingerprint(self.cfg), "algorithm": self.cfg.algorithm,
                "trainer": self.cfg.trainer.name, "aggregator": self.cfg.aggregator.name,
                "round": self.completed_round, "num_clients": len(self.client_ids),
                "torch_threads": torch.get_num_threads(), "partition_sha256": self.partition_sha256}
        save_checkpoint(self.run_dir, self._state(), meta)

    # -- rounds ------------------------------------------------------------------------------------------------
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
        metrics = per_client_metric(results)
        if metrics:
            self.logger.log_histogram(f"{self.task.metric_name}/per_client", list(metrics.values()))
        return summary

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
        if rnd % self.cfg.eval.every == 0 or rnd == self.cfg.rounds:
            ev_start = time.perf_counter()
            summary = self.evaluate_all(rnd)
            record.update(summary)
            record["eval_seconds"] = time.perf_counter() - ev_start
            self.history.add(rnd, summary)
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
        return self.logger.end_round()

    def run(self, stop_after: Optional[int] = None, on_round: Optional[Callable[[Dict[str, Any]], None]] = None,
            stop_in_setup: Optional[int] = None) -> Dict[str, Any]:
        """Run the remaining rounds (``stop_after``: pause after that round, as an interrupt would;
        ``stop_in_setup``: pause after that many resumable set-up steps)."""
        cfg = self.cfg
        reporter = (RoundReporter if self.is_writer else SilentReporter)(self.run_dir, cfg.rounds, self.completed_round, f"{cfg.algorithm}",
                                 self.task.metric_name, console=self.progress)
        interrupted = False
        failed = True
        try:
            # the run's thread setting holds for its rounds only; the process's own setting comes back afterwards
            with torch_threads(cfg.threads), reporter, _GracefulInterrupt() as stop:
                self._record_run_info(reporter)
                if not self.setup_done:
                    interrupted = not self._run_setup(stop, stop_in_setup, reporter)
                for rnd in ([] if interrupted else range(self.completed_round + 1, cfg.rounds + 1)):
                    started = time.perf_counter()
                    record = self.run_round(rnd)
                    self.completed_round = rnd
                    reporter.round(record, time.perf_counter() - started, self._postfix(record))
                    if on_round is not None:
                        on_round(record)
                    last = rnd == cfg.rounds
                    pause = self._stop_requested(stop) or (stop_after is not None and rnd >= stop_after)
                    if (last and cfg.checkpoint.get("final", True)) or pause or \
                            (cfg.checkpoint.every and rnd % cfg.checkpoint.every == 0):
                        self.checkpoint()
                    if pause and not last:
                        interrupted = True
                        break
                reporter.note(f"{'paused' if interrupted else 'finished'} after round {self.completed_round} of "
                              f"{cfg.rounds}")
            failed = False
        finally:
            self.logger.close()
            if failed:
                self.abandon()  # removes the directory only if this start created it and nothing was saved
        try:
            result = self.summary()
            result["interrupted"] = interrupted
            if self.is_writer:
                write_atomic(self.run_dir / "summary.json", json.dumps(strict_json(result), indent=2,
                                                                       allow_nan=False))
        finally:
            self._lock.release()
        return result

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
        runinfo.append(self.run_dir, entry)
        reporter.note(f"{event} at round {self.completed_round} of {self.cfg.rounds}: {self.cfg.algorithm} on "
                      f"{self.cfg.dataset.name}, {entry['threads']} torch thread(s), device {entry['device']}, "
                      f"host {entry['hostname']}, command: {entry['command']}")

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
        steps_fn = getattr(self.server, "setup_steps", None)
        if not callable(steps_fn):
            self.server.setup(self.channel)
        else:
            for n, step in enumerate(steps_fn(self.channel), start=1):
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

    def _postfix(self, record: Dict[str, Any]) -> Dict[str, str]:
        m = self.task.metric_name
        out = {}
        if "train_loss" in record:
            out["loss"] = f"{record['train_loss']:.3f}"
        if f"{m}/uniform" in record:
            out[m[:3]] = f"{record[f'{m}/uniform']:.4f}"
        return out

    def summary(self) -> Dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "algorithm": self.cfg.algorithm,
            "trainer": self.cfg.trainer.name,
            "aggregator": self.cfg.aggregator.name,
            **({"base": self.base_algorithm} if self.base_algorithm else {}),
            "dataset": self.cfg.dataset.name,
            "num_clients": len(self.client_ids),
            "rounds_completed": self.completed_round,
            "rounds": self.cfg.rounds,
            "seed": self.cfg.seed,
            **self.history.summary(self.cfg.eval.final_k),
            "bytes_up_total": self.totals["bytes_up"],
            "bytes_down_total": self.totals["bytes_down"],
            "client_failures": self.totals["failures"],
            "checkpoint_bytes": self._checkpoint_bytes(),
        }

    def _checkpoint_bytes(self) -> Optional[int]:
        path = self.run_dir / CHECKPOINT_NAME
        return path.stat().st_size if path.is_file() else None
