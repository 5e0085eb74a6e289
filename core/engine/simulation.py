"""One federated run: build its parts (data, model, clients, backend, server, communicator), hold their checkpoint
state, and sum the run up. ``Simulation(cfg).run()`` or ``Simulation.resume(run_dir).run()``.

Where each step of a run lives: the run directory in core/storage/rundir.py, resuming in core/engine/resume.py,
the round loop (set-up, select, round, evaluate, log, checkpoint cadence) in core/engine/rounds.py, the printed
report and summary.json's strict JSON in core/storage/reporting.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from easydict import EasyDict

from ..api import adaptation
from . import compose
from ..api import registry as reg
from .backend import ExecutionBackend, SerialBackend, StateOptions, TrainerFactory
from ..storage.checkpoint import CHECKPOINT_NAME, save_checkpoint
from ..api.clientstate import SPILL_DIR, parse_size
from ..api.serverstore import BUDGET_KEY as SERVER_BUDGET_KEY, SERVER_SPILL_DIR, ServerStores
from ..api.client import POOLED, ClientContext, client_state_backend
from .comm import Communicator
from .config import MAX_MODEL_PARAMETERS, config_fingerprint, to_plain
from ..data.data import FederatedData, build_federated_data
from ..common.errors import CheckpointError, ConfigError, PflError
from .evaluation import History
from .globaleval import GlobalEvaluation, global_model_of
from .assign import sgd_steps_per_epoch
from .batched import BatchedPlan, BatchedRunner, plan_from_config
from .silent import SilentRunLogger
from ..storage.monitor import RunLogger
from .privacy import PrivacyGuard
from .replies import ReplyChecks
from ..storage.reporting import strict_json
from .resume import ResumePoint, check_partition, load_resume_point, record_resume
from .rounds import RoundLoop, RunFailure
from ..storage.rundir import RunDirectory, default_run_dir, saved_splits
from ..common.seeding import derive_seed, rng_state, seed_everything, set_rng_state
from ..api.artifacts import SharedArtifacts
from ..api.server import ServerContext
from ..storage.artifacts import ArtifactFolder, run_key

# RunFailure, strict_json and default_run_dir live in rounds, reporting and rundir; importable from here as before
__all__ = ["Simulation", "RunFailure", "resolve_device", "make_model_factory", "check_model_fits_data",
           "default_run_dir", "strict_json"]


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
    _check_model_size(cfg, bundle.input_shape, bundle.task.output_dim)
    try:
        model = build_model()
    except Exception as exc:
        raise ConfigError(f"model '{cfg.model.name}' cannot be built for inputs of shape "
                          f"{tuple(bundle.input_shape)} with {bundle.task.output_dim} outputs: "
                          f"{type(exc).__name__}: {exc}") from exc
    _refuse_model_size(cfg, bundle.input_shape, sum(p.numel() for p in model.parameters()))
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


# a model option holding a number above this (a width, a vocabulary) may make a model too large to allocate: its
# parameters are counted on torch's meta device first. Not always: a forward pass on meta (which some builders run
# to size their head) first imports torch's meta kernels, about 1.5 s
LARGE_MODEL_OPTION = 10_000


def _model_args(cfg: EasyDict) -> Dict[str, Any]:
    return {k: v for k, v in cfg.model.items() if k not in ("name", "init_seed")}


def _has_large_number(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_large_number(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > LARGE_MODEL_OPTION


def _refuse_model_size(cfg: EasyDict, input_shape, count: int) -> None:
    if count > MAX_MODEL_PARAMETERS:
        shown = {k: v for k, v in _model_args(cfg).items() if not isinstance(v, (list, tuple)) or len(v) <= 8}
        raise ConfigError(f"model '{cfg.model.name}' with {shown} has {count:,} parameters for inputs of shape "
                          f"{tuple(input_shape)}; at most {MAX_MODEL_PARAMETERS:,} are allowed (fl show core): "
                          f"choose smaller widths or layers")


def _check_model_size(cfg: EasyDict, input_shape, output_dim: int) -> None:
    """Refuse a model of more than MAX_MODEL_PARAMETERS parameters before any memory is spent on it, when one of its
    options is large: it is built on torch's meta device (shapes only). A builder that cannot build there is left
    to the real build, whose parameters are counted too."""
    args = _model_args(cfg)
    if not any(_has_large_number(v) for v in args.values()):
        return
    builder = reg.MODELS.get(cfg.model.name)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = builder(input_shape=tuple(input_shape), num_classes=output_dim, **args)
        count = sum(p.numel() for p in model.parameters())
    except Exception:  # not buildable on meta (or not at all): the real build reports it
        return
    _refuse_model_size(cfg, input_shape, count)


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


class Simulation(RoundLoop):
    """One federated run. ``Simulation(cfg).run()`` or ``Simulation.resume(run_dir).run()``."""

    def __init__(self, cfg: EasyDict, run_dir: Optional[Path] = None, backend: Optional[ExecutionBackend] = None,
                 data: Optional[FederatedData] = None, progress: bool = False, tensorboard: bool = True,
                 _resume: Optional[ResumePoint] = None, artifacts_dir: Optional[Path] = None):
        self.cfg = cfg
        self.progress = progress
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir is not None else None  # core.api.artifacts
        self.device = resolve_device(cfg.device)
        # a distributed run replicates this loop on every process; only the writer (rank 0) writes the run directory
        self.is_writer = bool(getattr(backend, "is_writer", True))
        reuse_dir = _resume is not None  # a resume, or a restart: a run that died before its first checkpoint
        restart = reuse_dir and _resume.restart
        resume_state = None if _resume is None else _resume.state
        run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        seed_everything(cfg.seed, all_devices=True)

        # data and model are checked before anything is written, so bad input leaves no run directory behind;
        # a resumed run reloads its saved partition
        splits = saved_splits(run_dir, restart) if reuse_dir or not self.is_writer else None
        self.data = data if data is not None else build_federated_data(cfg, splits=splits)
        self.partition_sha256 = self.data.fingerprint()
        if _resume is not None:
            check_partition(_resume, self.partition_sha256)
        bundle = self.data.bundle
        self.task = bundle.task
        self.build_model = make_model_factory(cfg, bundle.input_shape, bundle.task.output_dim, self.device)
        check_model_fits_data(cfg, self.build_model, self.data, self.device)
        self.client_ids = list(range(self.data.num_clients))

        self.rundir = RunDirectory(run_dir, reuse=reuse_dir, is_writer=self.is_writer)
        self.run_dir = self.rundir.path
        try:
            self.rundir.take(from_round_zero=restart)
            if resume_state is None:
                self.rundir.write_start_files(to_plain(cfg), self.data)
            self._start(cfg, backend, resume_state, tensorboard)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Give the run directory up after a failed start: release the lock and, when this start created the
        directory and no checkpoint exists yet, remove it (a failed start leaves nothing half-made behind)."""
        logger = getattr(self, "logger", None)
        if logger is not None:
            logger.close()
        server_ctx = getattr(self, "server_ctx", None)
        if server_ctx is not None:  # a shared set-up result this start claimed goes to a run waiting for it
            server_ctx.artifacts.release()
        self.rundir.abandon()

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
            val = self.data.validation_tensors(cid, self.device)  # split.val; None without one
            held = [train, test] + ([val] if val is not None else [])
            self.guard.register(cid, [d.x for d in held], [d.y for d in held])
            self.contexts[cid] = ClientContext(
                cid=cid, train=train, test=test, task=self.task, device=self.device, hp=trainer_hp,
                train_cfg=cfg.train, build_model=self.build_model, num_clients=len(self.client_ids), seed=cfg.seed,
                adaptation=adapt, val=val)
        # the backend owns the clients' state: one live trainer each, or (a trainer that declares its state) a
        # pooled working trainer plus a store of declared states with a memory budget
        state_opts = StateOptions(parse_size(cfg.get("clients", {}).get("state_memory")), self.run_dir / SPILL_DIR)
        self.client_state_plan = client_state_backend(self.trainer_cls, self.aggregator_cls)
        pooled = self.client_state_plan["path"] == POOLED
        # failures.client_timeout (.get: a run saved before the key existed has no limit)
        limit_calls = getattr(self.backend, "limit_calls", None)  # an ExecutionBackend's; a duck-typed one has none
        if callable(limit_calls):
            limit_calls(cfg.failures.get("client_timeout"), self.run_dir)
        self.batched_plan = self._batched_plan(cfg)
        if not self.batched_plan.batched:
            _import_optimizer_machinery()
        self.backend.start(TrainerFactory(self.trainer_cls, self.contexts, pooled), self.client_ids, state_opts)

        self.logger = (RunLogger if self.is_writer else SilentRunLogger)(
            self.run_dir, resume_from_round=_resume_state["round"] if resuming else None, tensorboard=tensorboard)
        shared_keys = None
        shared_fn = getattr(self.trainer_cls, "shared_keys", None)
        if callable(shared_fn):
            shared_keys = shared_fn(self.build_model(), trainer_hp)
        # the server's per-client stores (core.api.serverstore): one budget, spilled under the run directory (each rank
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
                       "meta": self.data.bundle.meta}, stores=self.server_stores,
            artifacts=self._shared_artifacts(self.artifacts_dir, rank))
        self.server = self.aggregator_cls(self.server_ctx)
        # the aggregator's declared mean fields are folded as replies arrive (streaming aggregation); with
        # distributed.exact false each rank folds its own clients and the ranks all-reduce the sums; .get: a run
        # saved before the key existed resumes exact
        exact = bool(cfg.get("distributed", {}).get("exact", True))
        self.comm = Communicator(self.backend, self.client_ids, cfg.seed, self.guard,
                                 cfg.failures.on_client_error, cfg.failures.rollback,
                                 mean_fields=getattr(self.aggregator_cls, "reduced_fields", tuple)(),
                                 reduce_across_ranks=not exact,
                                 reply_weight=getattr(self.server, "reply_weight", None),
                                 checks=ReplyChecks.of_run(self.server, self.data.splits, self.task))
        self.channel = self.comm.channel()  # all the server strategy gets: it can send, nothing more
        self.history = History(self.task.metric_name, self.task.higher_is_better, keep_per_client=cfg.eval.final_k)
        self.global_eval = GlobalEvaluation(self.task.metric_name, self.task.higher_is_better, self.trainer_cls, adapt)
        self.completed_round = 0
        self.setup_done = False
        self.setup_calls = 0  # messages sent during set-up so far (resumed set-up continues their seeds)
        self.totals = {"bytes_up": 0, "bytes_down": 0, "failures": 0}
        self.failures: List[Dict[str, Any]] = []
        self._checkpointed_round: Optional[int] = None  # the round the last checkpoint this process wrote holds
        if resuming:
            self._restore(_resume_state)
        else:
            self.logger.log_text("config", "```\n" + json.dumps(to_plain(cfg), indent=2) + "\n```")

    def _batched_plan(self, cfg: EasyDict) -> BatchedPlan:
        """clients.batched: which path the fit calls take (core/engine/batched.py); the backend gets the runner."""
        first = min(self.contexts) if self.contexts else None
        plan = plan_from_config(cfg, self.trainer_cls, self.device,
                                lambda: self.trainer_cls(self.contexts[first]))
        if plan.batched:
            if not callable(getattr(self.backend, "use_batched", None)):
                if plan.mode == "on":
                    raise ConfigError(f"clients.batched=on: the execution backend {type(self.backend).__name__} "
                                      f"cannot batch clients; use clients.batched=auto or off")
                return BatchedPlan(plan.mode, False, f"the execution backend {type(self.backend).__name__} cannot "
                                                     f"batch clients", plan.stack)
            self.backend.use_batched(BatchedRunner(plan, self.device))
        return plan

    def _shared_artifacts(self, folder: Optional[Path], rank: Any) -> SharedArtifacts:
        """The run's shared set-up results (core.api.artifacts): through ``folder`` when given, except in a
        distributed run, whose ranks must all take the same path (one might find a file another did not)."""
        if folder is None or isinstance(rank, int):
            return SharedArtifacts()
        key = run_key(self.cfg, self.partition_sha256, (self.aggregator_cls, self.trainer_cls),
                      device=self.device.type)
        return ArtifactFolder(Path(folder), key, run_dir=self.run_dir, meter=self._artifact_meter,
                              replay=self._artifact_replay)

    def _artifact_meter(self) -> Dict[str, int]:
        """Messages sent in this phase so far and the run's traffic so far (totals and this phase's)."""
        traffic = self.comm.traffic
        return {"calls": int(self.comm._calls), "bytes_up": int(self.totals["bytes_up"] + traffic.bytes_up),
                "bytes_down": int(self.totals["bytes_down"] + traffic.bytes_down)}

    def _artifact_replay(self, cost: Mapping[str, int]) -> None:
        """Count the messages a loaded result replaced as sent (their numbers seed the clients' later calls)."""
        self.comm._calls += int(cost["calls"])
        self.comm.traffic.bytes_up += int(cost["bytes_up"])
        self.comm.traffic.bytes_down += int(cost["bytes_down"])

    # -- resume ------------------------------------------------------------------------------------------------
    @classmethod
    def resume(cls, run_dir: Path, overrides: Optional[Dict[str, Any]] = None, **kwargs) -> "Simulation":
        """Continue the run in ``run_dir`` from its checkpoint; ``overrides`` may change resume-safe keys only.

        The checkpoint must match ``config.json`` (its header holds the configuration's hash), so an edited
        configuration or a checkpoint copied from another run is refused. A run that died before its first
        checkpoint starts again from round 0 in the same directory, with its saved configuration and partition
        (core/engine/resume.py checks and loads all of it).
        """
        point = load_resume_point(run_dir, overrides)
        sim = cls(point.cfg, run_dir=point.run_dir, _resume=point, **kwargs)
        if sim.is_writer:
            record_resume(point)
        return sim

    # -- checkpoint state --------------------------------------------------------------------------------------
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
            "global_history": self.global_eval.state_dict(),
            "totals": dict(self.totals),
            "failures": list(self.failures),
            "rng": rng_state(),
            **({"shared_artifacts": {"events": list(self.server_ctx.artifacts.events),
                                     "pending": dict(self.server_ctx.artifacts.pending)}}
               if self.server_ctx.artifacts.events or self.server_ctx.artifacts.pending else {}),
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
        self.global_eval.load_state_dict(state.get("global_history"))  # .get: a checkpoint from before it existed
        self.completed_round = int(state["round"])
        self.setup_done = bool(state["setup_done"])
        self.setup_calls = int(state.get("setup_calls", 0))
        self.totals = dict(state["totals"])
        shared = state.get("shared_artifacts") or {}
        self.server_ctx.artifacts.events[:0] = [dict(e) for e in shared.get("events", [])]
        self.server_ctx.artifacts.pending.update({str(k): dict(v) for k, v in shared.get("pending", {}).items()})
        self.server_ctx.artifacts.reclaim()  # a make paused by the checkpoint holds its lock again
        self.failures = list(state["failures"])
        set_rng_state(state["rng"])
        self._checkpointed_round = self.completed_round

    def checkpoint(self) -> None:
        """Write the run's checkpoint now (rank 0 writes; other ranks send it their clients' states)."""
        if not self.is_writer:  # rank 0 writes; the others send it their clients' states, in the same order
            for cid in self.client_ids:
                self.backend.get_state(cid)
            self._checkpointed_round = self.completed_round
            return
        meta = {"config_sha256": config_fingerprint(self.cfg), "algorithm": self.cfg.algorithm,
                "trainer": self.cfg.trainer.name, "aggregator": self.cfg.aggregator.name,
                "round": self.completed_round, "num_clients": len(self.client_ids),
                "torch_threads": torch.get_num_threads(), "partition_sha256": self.partition_sha256}
        save_checkpoint(self.run_dir, self._state(), meta)
        self._checkpointed_round = self.completed_round

    # -- result ------------------------------------------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        """The run's summary: what ``summary.json`` holds (final and best metrics, traffic, failures)."""
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
            "global": self.global_eval.summary(self.cfg.eval.final_k, global_model_of(self.server) is not None),
            "bytes_up_total": self.totals["bytes_up"],
            "bytes_down_total": self.totals["bytes_down"],
            "client_failures": self.totals["failures"],
            "clients_batched": {**self.batched_plan.as_dict(), **self._batched_counts()},
            "clients_state": dict(self.client_state_plan),
            "checkpoint_bytes": self._checkpoint_bytes(),
            **({"shared_artifacts": list(self.server_ctx.artifacts.events)}
               if self.server_ctx.artifacts.events else {}),
        }

    def _batched_counts(self) -> Dict[str, int]:
        """This process's batched groups and evaluation passes, and the ones that fell back to one client at a time
        (a resumed run counts from its resume)."""
        runner = getattr(self.backend, "batched", None)
        if runner is None or not self.batched_plan.batched:
            return {}
        return {"groups_run": int(runner.groups_run), "group_fallbacks": int(runner.fallbacks),
                "evaluations_batched": int(runner.evaluations_run),
                "evaluation_fallbacks": int(runner.evaluation_fallbacks)}

    def _checkpoint_bytes(self) -> Optional[int]:
        path = self.run_dir / CHECKPOINT_NAME
        return path.stat().st_size if path.is_file() else None


def _import_optimizer_machinery() -> None:
    """The first torch optimizer a process builds imports ``torch._dynamo`` (``Optimizer.add_param_group`` is wrapped
    by ``torch._disable_dynamo``): 0.9-2.5 s and 110-150 MiB (docs/performance.md, "Round overhead"). A sequential client builds one in
    round 1, so the import is paid here, in the set-up, and round 1 -- which the run-time estimate and the round
    timers see -- costs what the later rounds cost. The batched path builds no optimizer and skips it."""
    import torch._dynamo  # noqa: F401
