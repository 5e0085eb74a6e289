"""The federated simulation: build clients and server, run rounds, evaluate every client, log, checkpoint."""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from easydict import EasyDict

from . import registry as reg
from .backend import ExecutionBackend, SerialBackend
from .checkpoint import load_checkpoint, save_checkpoint
from .client import ClientContext
from .comm import Communicator
from .config import to_plain
from .data import ClientSplit, FederatedData, build_federated_data
from .errors import CheckpointError, ConfigError, PflError
from .evaluation import History, per_client_metric, summarize
from .monitor import RunLogger
from .seeding import derive_seed, rng_state, seed_everything, set_rng_state
from .server import ServerContext

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
    """Every call returns the same initial weights (seeded), on ``device``: clients and server start equal."""
    builder = reg.MODELS.get(cfg.model.name)
    args = {k: v for k, v in cfg.model.items() if k != "name"}
    init_seed = derive_seed(cfg.seed, "model-init")

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


def prepare_run_dir(path: Path, exist_ok: bool = False) -> Path:
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
                 progress: bool = False, tensorboard: bool = True):
        self.cfg = cfg
        self.progress = progress
        self.device = resolve_device(cfg.device)
        resuming = _resume_state is not None
        run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        seed_everything(cfg.seed)

        # data and model are checked before anything is written, so bad input leaves no run directory behind;
        # a resumed run reloads its saved partition
        splits = None
        if resuming and (run_dir / "partition.json").exists():
            splits = FederatedData.load_splits(run_dir / "partition.json")
        self.data = data if data is not None else build_federated_data(cfg, splits=splits)
        bundle = self.data.bundle
        self.task = bundle.task
        self.build_model = make_model_factory(cfg, bundle.input_shape, bundle.task.output_dim, self.device)
        check_model_fits_data(cfg, self.build_model, self.data, self.device)
        self.client_ids = list(range(self.data.num_clients))

        self.run_dir = prepare_run_dir(run_dir, exist_ok=resuming)
        if not resuming:
            (self.run_dir / "config.json").write_text(json.dumps(to_plain(cfg), indent=2))
            self.data.save(self.run_dir / "partition.json")

        self.trainer_cls = reg.TRAINERS.get(cfg.trainer.name)
        self.aggregator_cls = reg.AGGREGATORS.get(cfg.aggregator.name)
        trainer_hp = EasyDict({k: v for k, v in cfg.trainer.items() if k != "name"})
        self._trainer_hp = trainer_hp

        # clients: each context holds that client's tensors only
        self._private: Dict[int, set] = {}
        self.contexts: Dict[int, ClientContext] = {}
        for cid in self.client_ids:
            train, test = self.data.client_tensors(cid, self.device)
            self._private[cid] = {t.untyped_storage().data_ptr() for t in (train.x, train.y, test.x, test.y)}
            self.contexts[cid] = ClientContext(
                cid=cid, train=train, test=test, task=self.task, device=self.device, hp=trainer_hp,
                train_cfg=cfg.train, build_model=self.build_model, num_clients=len(self.client_ids), seed=cfg.seed)
        self.backend = backend or SerialBackend()
        self.backend.start(lambda cid: self.trainer_cls(self.contexts[cid]), self.client_ids)

        self.logger = RunLogger(self.run_dir, resume_from_round=_resume_state["round"] if resuming else None,
                                tensorboard=tensorboard)
        shared_keys = None
        shared_fn = getattr(self.trainer_cls, "shared_keys", None)
        if callable(shared_fn):
            shared_keys = shared_fn(self.build_model(), trainer_hp)
        self.server_ctx = ServerContext(
            hp=EasyDict({k: v for k, v in cfg.aggregator.items() if k != "name"}), cfg=cfg, task=self.task,
            num_clients=len(self.client_ids), build_model=self.build_model, shared_keys=shared_keys,
            device=self.device, seed=cfg.seed, logger=self.logger, rng=np.random.default_rng(cfg.seed))
        self.server = self.aggregator_cls(self.server_ctx)
        self.comm = Communicator(self.backend, self.client_ids, cfg.seed, self._private,
                                 cfg.failures.on_client_error, cfg.failures.rollback)
        self.history = History(self.task.metric_name, self.task.higher_is_better)
        self.completed_round = 0
        self.setup_done = False
        self.totals = {"bytes_up": 0, "bytes_down": 0, "failures": 0}
        self.failures: List[Dict[str, Any]] = []
        if resuming:
            self._restore(_resume_state)
        else:
            self.logger.log_text("config", "```\n" + json.dumps(to_plain(cfg), indent=2) + "\n```")

    # -- resume ------------------------------------------------------------------------------------------------
    @classmethod
    def resume(cls, run_dir: Path, **kwargs) -> "Simulation":
        from .config import resolve

        run_dir = Path(run_dir)
        cfg_path = run_dir / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{run_dir} is not a run directory (no config.json)")
        state = load_checkpoint(run_dir)
        try:
            saved = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_path} is corrupt: {exc}") from exc
        cfg = resolve([saved])
        return cls(cfg, run_dir=run_dir, _resume_state=state, **kwargs)

    def _state(self) -> Dict[str, Any]:
        return {
            "round": self.completed_round,
            "setup_done": self.setup_done,
            "server": self.server.state_dict(),
            "clients": {cid: self.backend.get_state(cid) for cid in self.client_ids},
            "history": self.history.state_dict(),
            "totals": dict(self.totals),
            "failures": list(self.failures),
            "rng": rng_state(),
        }

    def _restore(self, state: Dict[str, Any]) -> None:
        if set(state["clients"]) != set(self.client_ids):
            raise CheckpointError("checkpoint clients do not match the run's partition")
        self.server.load_state_dict(state["server"])
        for cid, cstate in state["clients"].items():
            self.backend.set_state(cid, cstate)
        self.history.load_state_dict(state["history"])
        self.completed_round = int(state["round"])
        self.setup_done = bool(state["setup_done"])
        self.totals = dict(state["totals"])
        self.failures = list(state["failures"])
        set_rng_state(state["rng"])

    def checkpoint(self) -> None:
        save_checkpoint(self.run_dir, self._state())

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
        summary = summarize(results, self.task.metric_name)
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
        self.server.run_round(rnd, selected, self.comm)
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
        self.logger.log_scalars({k: v for k, v in record.items() if isinstance(v, (int, float))})
        return self.logger.end_round()

    def run(self, stop_after: Optional[int] = None, on_round: Optional[Callable[[Dict[str, Any]], None]] = None
            ) -> Dict[str, Any]:
        """Run the remaining rounds (``stop_after``: pause after that round, as an interrupt would)."""
        cfg = self.cfg
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.rounds, initial=self.completed_round, desc=f"{cfg.algorithm}", unit="round",
                       dynamic_ncols=True, disable=None)  # None: no bar when stderr is not a terminal
        interrupted = False
        try:
            with _GracefulInterrupt() as stop:
                if not self.setup_done:
                    self.logger.set_step(0)
                    self.comm.begin_round(0)
                    self.server.setup(self.comm)
                    self.setup_done = True
                for rnd in range(self.completed_round + 1, cfg.rounds + 1):
                    record = self.run_round(rnd)
                    self.completed_round = rnd
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(self._postfix(record))
                    if on_round is not None:
                        on_round(record)
                    last = rnd == cfg.rounds
                    pause = stop.requested or (stop_after is not None and rnd >= stop_after)
                    if last or pause or (cfg.checkpoint.every and rnd % cfg.checkpoint.every == 0):
                        self.checkpoint()
                    if pause and not last:
                        interrupted = True
                        break
        finally:
            if bar is not None:
                bar.close()
            self.logger.close()
        result = self.summary()
        result["interrupted"] = interrupted
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        return result

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
            "dataset": self.cfg.dataset.name,
            "num_clients": len(self.client_ids),
            "rounds_completed": self.completed_round,
            "rounds": self.cfg.rounds,
            "seed": self.cfg.seed,
            **self.history.summary(self.cfg.eval.final_k),
            "bytes_up_total": self.totals["bytes_up"],
            "bytes_down_total": self.totals["bytes_down"],
            "client_failures": self.totals["failures"],
        }
